"""PIR program passes for Paddle static programs: loop inputs kept sound, loop-carried copies dropped.

How Paddle 3.3's executor runs a ``pd_op.while`` (while_instruction.cc, yield_instruction.cc,
dependency_builder.cc, pir_interpreter.cc; each point is shown by a test in tests/paddle_tests):

(E1) Buffers. When the loop starts, result k shares operand k's buffer; each iteration, block
     argument k shares result k's buffer; after the body, result k shares the buffer of the value
     yielded in slot k. An in-place op (``assign_out_``, ``add_``...) writes its operand's variable,
     and its result *is* that variable. So ``paddle.assign(new, output=loop_var)`` in a body writes
     the buffer of the value that fed the loop, in the first iteration and, while the slot keeps
     yielding that buffer, in every later one.
(E2) Ordering. Instructions are ordered only through the variables they read and write. The while
     is recorded as reading its operands; its body's writes to a block argument are invisible
     outside it. An op that reads an operand (before or after the loop) and the loop that writes
     that operand's buffer get no edge between them.
(E3) Schedules. ``Executor.run`` runs a program on a thread pool, in any order the edges allow:
     such a read sees the operand before, during or after the loop. ``run_program`` (to_static,
     SOT) traces one order, program order.
(E4) Memory. A while releases its operands' variables when it starts. An op that reads an
     operand after the loop then fails with "Tensor holds no memory"; a persistable operand is
     gone for the next run. Fed ``pd_op.data`` variables, and reads from inside the body, are not
     affected.

A program has one of two meanings, and the passes take it as ``semantics``:

* ``"static"`` (programs built with the static API and run by an Executor): values are values. A
  loop's operand keeps the value it had; ``assign(new, output=loop_var)`` updates the loop's state,
  not the tensor that fed it. (E1)+(E2) break that in some runs, and (E4) in every run.
* ``"eager"`` (programs SOT traced from dygraph code, run by run_program): program order, with
  in-place writes seen by every later read of the same tensor, as in the dygraph code; the
  buffer sharing of (E1) mirrors Python's references there. Only (E4) breaks it.

protect_inplace_writes (the safety pass; it runs first)
    For every loop, innermost first, it finds the operands whose buffer the body may write
    (directly, through a value that shares it, through a nested loop, or through a slot that
    yields another slot's buffer). With static semantics such an operand gets one copy before the
    loop when anything else can see its buffer: another op reading it or a value sharing it
    (anywhere, before or after the loop, inside the body too), persistable state, or a second
    slot of the same loop. An operand read after the loop (E4) gets that copy too, written or not.
    With eager semantics the writes are the meaning: a read after the loop of a slot that holds
    the operand's buffer throughout is rewired to the loop's result (the same buffer, and ordered
    after the loop); any other operand read after the loop gets the copy. A block argument of an
    enclosing loop that nothing else reads is left to that loop's own analysis (no copy per outer
    iteration). A copy goes in only where the argument above needs it.
    Not only loops share buffers: an if's result is the buffer its taken branch yielded, and a
    share_data_ result its input's. With static semantics an in-place write into such a value
    gets a copy to write instead, and the later reads of that variable read the write's result.
    Copies are built as empty_like + assign_out_: Paddle's inplace pass would turn a plain assign
    whose input dies there back into a shared buffer.

remove_loop_carried_copies
    Loop state written as ``paddle.assign(new, output=loop_var)`` becomes
    ``%r = pd_op.assign_out_(%src, %arg_k)`` yielded in slot k: one full copy of the state per
    iteration. The pass erases the copy and yields ``%src``. After the rewrite block argument k
    holds the operand's buffer in the first iteration and ``%src``'s afterwards, and no op writes
    it: the rewrite removes writes and adds none. It is safe when

    * nothing in the body reads ``%arg_k`` or a value sharing it after the copy (those reads see
      the new value today), and nothing else writes it;
    * ``%src`` is a fresh buffer each iteration: computed in the body by an ordinary op (not in
      place, not a view, not control flow), not persistable, yielded nowhere else, only read. The
      executor releases ``%src``'s variable after the yield, so the next iteration's op allocates
      a new buffer instead of writing the one the argument still holds. That needs its garbage
      collection (``FLAGS_eager_delete_tensor_gb >= 0``, the default); with it off the pass does
      nothing;
    * ``%r`` is yielded once, in slot k, and otherwise only read;
    * with eager semantics only: nothing may see the operand's buffer change after the loop
      starts, because the writes this removes are the meaning there. The operand is then a fresh
      value of the loop's block, used once by the loop and by nothing after it, not fed from
      outside (``pd_op.data`` shares the caller's tensor under run_program) and not persistable,
      or a block argument of an enclosing loop that passes the same test for its own slot.

    With static semantics the operand needs no condition: removing the writes is what its
    meaning asks for. Anything the argument does not cover keeps its copy.

Rewrite a program before its first run: executors cache what they compiled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import paddle

_WHILE = "pd_op.while"
_YIELD = "cf.yield"
_COPY = "pd_op.assign_out_"
_DATA = "pd_op.data"
_IF = "pd_op.if"
_SHARE = ("pd_op.share_data_", "pd_op.share_data")
# Ops that may hand out a buffer they did not allocate without being marked in-place.
_SHARING_NAME_PARTS = ("share", "view", "strided", "unfold", "shadow", "array_read", "data", "feed")

SEMANTICS = ("static", "eager")


@dataclass
class PassResult:
    """What the passes did to one program."""

    copies_inserted: int = 0  # loop operands copied before their loop (protect_inplace_writes)
    reads_rewired: int = 0  # reads after a loop moved to the loop's result (eager semantics)
    copies_removed: int = 0  # loop-carried assign_out_ copies erased (remove_loop_carried_copies)
    inserted_ops: List[object] = field(default_factory=list, repr=False)

    def as_dict(self) -> Dict[str, int]:
        return {"copies_inserted": self.copies_inserted, "reads_rewired": self.reads_rewired,
                "copies_removed": self.copies_removed}


# -- what an op does to its operands' buffers -------------------------------------------------------

def _inplace_map(op) -> dict:
    try:
        return dict(paddle.base.libpaddle.pir.get_op_inplace_info(op))
    except Exception:  # not every op carries yaml info; fall back to the naming convention
        return {}


def _is_plain(op) -> bool:
    """An op that only reads its operands and writes freshly allocated results."""
    name = op.name()
    if not name.startswith("pd_op.") or name.endswith("_") or op.num_regions() > 0:
        return False
    if any(part in name for part in _SHARING_NAME_PARTS):
        return False
    return not _inplace_map(op)


def _aliased_operands(op) -> set:
    """Positions of op's operands that op may write, or whose buffer a result of op may share."""
    if _is_plain(op):
        return set()
    name = op.name()
    inplace = _inplace_map(op)
    if inplace and name.startswith("pd_op.") and op.num_regions() == 0:
        if not any(part in name for part in _SHARING_NAME_PARTS):
            return set(inplace.values())
    return set(range(op.num_operands()))


def _positions(op, value) -> set:
    return {i for i, v in enumerate(op.operands_source()) if v.id == value.id}


def _aliases_operand(op, value) -> bool:
    return bool(_aliased_operands(op) & _positions(op, value))


def _writes(op, value, clobbers: Dict[int, Set[int]]) -> bool:
    """op writes value's buffer: an in-place operand, or a loop whose body writes that operand."""
    if op.name() == _WHILE:
        slots = clobbers.get(op.id(), set())
        return any(p - 1 in slots for p in _positions(op, value) if p > 0)
    inplace = _inplace_map(op)
    if inplace:
        return bool(set(inplace.values()) & _positions(op, value))
    return op.name().endswith("_") and bool(_positions(op, value))


def _reads_only(op, value) -> bool:
    """op reads value, never writes it, and none of its results shares value's buffer."""
    if op.name() == "builtin.combine":  # packs tensors for concat/stack/...: follow the vector
        return all(_reads_only(u, res) for res in op.results() for u in res.all_used_ops())
    return not _aliases_operand(op, value)


def _count(values: Iterable, value) -> int:
    return sum(1 for v in values if v.id == value.id)


class _Index:
    """Positions of every op of a program, in program order, and the owners of block arguments."""

    def __init__(self, program) -> None:
        self.pos: Dict[int, Tuple[int, ...]] = {}
        self.op_of: Dict[int, object] = {}
        self.arg_owner: Dict[object, Tuple[object, object, int]] = {}
        self.copies: List[object] = []
        self.loops: List[object] = []  # innermost first
        self._walk(program.global_block(), ())

    def _walk(self, block, prefix: Tuple[int, ...]) -> None:
        for i, op in enumerate(block.ops):
            path = prefix + (i,)
            self.pos[op.id()] = path
            self.op_of[op.id()] = op
            if op.name() == _COPY:
                self.copies.append(op)
            for b, sub in enumerate(op.blocks()):
                for k, arg in enumerate(sub.args()):
                    self.arg_owner[arg.id] = (op, sub, k)
                self._walk(sub, path + (b,))
            if op.name() == _WHILE:
                self.loops.append(op)

    def ops_inside(self, ref) -> List[object]:
        return [self.op_of[i] for i, p in self.pos.items() if self.inside(self.op_of[i], ref)]

    def after(self, op, ref) -> bool:
        """op runs after ref started: later in program order, or nested inside ref."""
        return self.pos[op.id()] > self.pos[ref.id()]

    def inside(self, op, ref) -> bool:
        p, r = self.pos[op.id()], self.pos[ref.id()]
        return len(p) > len(r) and p[: len(r)] == r

    def same_block(self, op, ref) -> bool:
        return self.pos[op.id()][:-1] == self.pos[ref.id()][:-1]


# -- buffers ------------------------------------------------------------------------------------------

def _forward_aliases(value, skip_op=None) -> List[object]:
    """value plus every value that may share its buffer through ops that use it (except skip_op)."""
    seen = {value.id: value}
    work = [value]
    while work:
        v = work.pop()
        for user in v.all_used_ops():
            if skip_op is not None and user.id() == skip_op.id():
                continue
            if user.name() == _YIELD:
                parent = user.get_parent_block().parent_op
                outs = list(parent.results()) if parent is not None else []
            elif _aliases_operand(user, v):
                outs = list(user.results())
            else:
                continue
            for res in outs:
                if res.id not in seen:
                    seen[res.id] = res
                    work.append(res)
    return list(seen.values())


def _sources(value, depth: int = 0) -> List[object]:
    """The values whose buffer value may be: back through in-place results, shares and views."""
    op = value.get_defining_op()
    if op is None or depth > 64:
        return [value]
    if op.name() in _SHARE:
        return _sources(op.operand_source(0), depth + 1)
    inplace = _inplace_map(op)
    if inplace and value.index() in inplace:
        return _sources(op.operand_source(inplace[value.index()]), depth + 1)
    if _is_plain(op) or op.name() in (_DATA, "pd_op.full", "pd_op.full_int_array"):
        return [value]
    if op.name() == _WHILE:  # a loop result holds its operand's buffer or a yielded one
        k = value.index()
        found = _sources(op.operand_source(k + 1), depth + 1)
        body = _body(op)
        found += _sources(body.ops[-1].operand_source(k + 1), depth + 1)
        return found
    if op.name() == _IF:  # a branch's yielded value, shared, not copied
        found = []
        for block in op.blocks():
            last = block.ops[-1] if len(block.ops) else None
            if last is None or last.name() != _YIELD:
                return [value]
            found += _sources(last.operand_source(value.index()), depth + 1)
        return found
    found = [value]  # anything else: conservatively every aliased operand too
    for pos in _aliased_operands(op):
        found += _sources(op.operand_source(pos), depth + 1)
    return found


def _ancestors(idx: "_Index", loop) -> Set[int]:
    """Ops the loop depends on through the values it reads: they finish before it starts."""
    work = list(loop.operands_source())
    for op in idx.ops_inside(loop):  # values the body reads from outside are loop inputs too
        work += [v for v in op.operands_source() if not _defined_in(idx, v, loop)]
    seen: Set[int] = set()
    while work:
        op = work.pop().get_defining_op()
        if op is None or op.id() in seen:
            continue
        seen.add(op.id())
        work += list(op.operands_source())
    return seen


def _shares_buffer_with(value, outputs: Set[object], loop) -> bool:
    return any(alias.id in outputs for src in _sources(value) for alias in _forward_aliases(src, skip_op=loop))


def _buffer_users(idx: "_Index", value, loop, ignore: Set[int] = frozenset()) -> List[object]:
    """Ops other than loop that use value's buffer under any name, and may run while it runs.

    The loop's results are not followed (they are meant to hold what the loop wrote), nor are ops
    the loop depends on (the executor orders them first)."""
    skip = {loop.id()} | _ancestors(idx, loop) | set(ignore)
    users, seen = [], set()
    for src in _sources(value):
        for alias in _forward_aliases(src, skip_op=loop):
            for user in alias.all_used_ops():
                if user.id() not in skip and user.id() not in seen:
                    seen.add(user.id())
                    users.append(user)
    return users


# -- the loop analysis --------------------------------------------------------------------------------

@dataclass
class _Loop:
    op: object
    body: object
    args: list
    yielded: list  # the value yielded in each slot
    written: Set[int]  # slots whose block argument's buffer the body writes
    holds: Dict[int, Set[int]]  # slot k -> operand slots whose buffer argument k may hold
    outer: Dict[int, List[object]]  # slot k -> outer values whose buffer argument k may hold

    def clobbered(self) -> Set[int]:
        """Operand slots whose buffer the loop may write."""
        return {j for k in self.written for j in self.holds[k]}

    def keeps_buffer(self, j: int) -> bool:
        """Argument j holds operand j's buffer in every iteration: the result is that buffer."""
        sources = _sources(self.yielded[j])
        return self.holds[j] == {j} and not self.outer[j] and all(s.id == self.args[j].id for s in sources)


def _analyse(idx: _Index, loop, clobbers: Dict[int, Set[int]]) -> Optional[_Loop]:
    body = _body(loop)
    args = list(body.args())
    yield_op = body.ops[-1] if len(body.ops) else None
    if (yield_op is None or yield_op.name() != _YIELD or yield_op.num_operands() != len(args) + 1
            or loop.num_operands() != len(args) + 1 or loop.num_results() != len(args)):
        return None
    yielded = [yield_op.operand_source(k + 1) for k in range(len(args))]
    arg_slot = {a.id: k for k, a in enumerate(args)}
    written = set()
    for k, arg in enumerate(args):
        for alias in _forward_aliases(arg):
            if any(_writes(user, alias, clobbers) for user in alias.all_used_ops()):
                written.add(k)
                break
    edges: Dict[int, Set[int]] = {k: set() for k in range(len(args))}
    outer: Dict[int, List[object]] = {k: [] for k in range(len(args))}
    for k, value in enumerate(yielded):
        for src in _sources(value):
            if src.id in arg_slot:
                edges[k].add(arg_slot[src.id])
            elif not _defined_in(idx, src, loop):
                outer[k].append(src)
    holds = {}
    for k in edges:  # operand buffers reach slot k through chains of yields
        reach, work = {k}, [k]
        while work:
            for m in edges[work.pop()]:
                if m not in reach:
                    reach.add(m)
                    work.append(m)
        holds[k] = reach
        for m in reach:
            outer[k] = outer[k] + [v for v in outer[m] if all(v.id != o.id for o in outer[k])]
    return _Loop(loop, body, args, yielded, written, holds, outer)


def _body(loop):
    return list(loop.blocks())[0]


def all_clobbers(idx: _Index) -> Dict[int, Set[int]]:
    """loop op id -> operand slots whose buffer the loop may write, for every loop of the program."""
    clobbers: Dict[int, Set[int]] = {}
    for loop in idx.loops:
        info = _analyse(idx, loop, clobbers)
        clobbers[loop.id()] = info.clobbered() if info is not None else set(range(loop.num_operands() - 1))
    return clobbers


def _defined_in(idx: "_Index", value, loop) -> bool:
    """value is computed (or is a block argument) inside loop's body, nested blocks included."""
    op = value.get_defining_op()
    if op is None:
        owner = idx.arg_owner.get(value.id)
        return owner is not None and (owner[0].id() == loop.id() or idx.inside(owner[0], loop))
    return op.id() in idx.pos and idx.inside(op, loop)


def _is_fed(value) -> bool:
    op = value.get_defining_op()
    return op is not None and op.name() == _DATA


def _reads_after(idx: _Index, value, loop) -> List[object]:
    """Ops that use value after loop, in program order (its body's own reads not included)."""
    return [u for u in value.all_used_ops()
            if u.id() != loop.id() and idx.after(u, loop) and not idx.inside(u, loop)]


def _fresh_copy(value, before):
    """A copy of value in a buffer of its own, built right before op `before`.

    Written as empty_like + assign_out_, not assign: Paddle's inplace pass turns an assign whose
    input dies there into one that shares the input's buffer, which would undo the copy."""
    saved = paddle.pir.get_current_insertion_point()
    paddle.pir.set_insertion_point(before)
    try:
        buffer = paddle._pir_ops.empty_like(value, value.dtype, paddle.base.core.Place())
        return paddle._pir_ops.assign_out_(value, buffer)
    finally:
        paddle.pir.set_insertion_point(saved)


def _erase_copy(copy_op) -> None:
    buffer_op = copy_op.operand_source(1).get_defining_op()
    copy_op.erase()
    buffer_op.erase()


def _copy_before(loop, j: int):
    """Give the loop's slot j a fresh copy of its operand, made right before the loop."""
    copy = _fresh_copy(loop.operand_source(j + 1), loop)
    loop.operand(j + 1).set_source(copy)
    return copy.get_defining_op()


def _copy_needed(idx: _Index, info: _Loop, j: int, semantics: str, outputs: Optional[Set[object]],
                 ignore: Set[int] = frozenset()) -> bool:
    """Whether slot j's operand needs a copy of its own before the loop (ignore: ops to overlook,
    such as a copy being reconsidered)."""
    loop = info.op
    value = loop.operand_source(j + 1)
    owner = idx.arg_owner.get(value.id)
    enclosing_arg = owner is not None and owner[0].name() == _WHILE
    if value.persistable:
        return True  # the loop releases it (E4): without a copy the next run finds no memory
    reads_after = [u for u in _reads_after(idx, value, loop) if u.id() not in ignore]
    if reads_after and not _is_fed(value) and not enclosing_arg:
        return True  # E4: the read after the loop would find no memory
    if semantics == "eager" or j not in info.clobbered():
        return False
    # Static semantics: the operand's value must survive the loop wherever it can be seen. A
    # block argument of an enclosing loop that nothing else uses is left to that loop's analysis
    # (which sees this loop write its argument). Any other value may be fetched after the run,
    # unless the caller named what it fetches.
    if _count(loop.operands_source()[1:], value) > 1 or _buffer_users(idx, value, loop, ignore):
        return True
    if enclosing_arg:
        return False
    return outputs is None or _shares_buffer_with(value, outputs, loop)


def protect_inplace_writes(program, semantics: str = "static", result: Optional[PassResult] = None,
                        outputs: Optional[Sequence[object]] = None) -> PassResult:
    """Make every schedule of every while loop give the program's meaning; see the module docstring.

    outputs: the values the caller will fetch, when known; then a value nothing reads needs no copy.
    """
    _check(program, semantics)
    result = result or PassResult()
    fetched = None if outputs is None else {v.id for v in outputs}
    idx = _Index(program)
    clobbers: Dict[int, Set[int]] = {}
    for loop in idx.loops:  # innermost first: an inner loop's writes count as the outer body's
        info = _analyse(idx, loop, clobbers)
        if info is None:
            clobbers[loop.id()] = set(range(max(0, loop.num_operands() - 1)))
            continue
        clobbered = info.clobbered()
        if semantics == "eager":
            for j in sorted(clobbered):
                if info.keeps_buffer(j):
                    result.reads_rewired += _rewire_reads_after(idx, loop, j)
        else:
            for k in sorted(info.written):
                if info.outer[k]:  # the slot hands an outside buffer to the next iteration
                    _copy_yielded(info, k)
                    result.copies_inserted += 1
        for j in range(len(info.args)):
            if _copy_needed(idx, info, j, semantics, fetched):
                result.inserted_ops.append(_copy_before(loop, j))
                result.copies_inserted += 1
                clobbered.discard(j)
        clobbers[loop.id()] = clobbered
        idx = _Index(program)
    if semantics == "static":
        _protect_shared_results(program, result)
    return result


def _shared_sources(value) -> List[object]:
    """Values, other than value's own variable, whose buffer value holds without a copy: the
    yielded values behind an if's result, the input of a share_data_."""
    op = value.get_defining_op()
    if op is None:
        return []
    inplace = _inplace_map(op)
    if inplace and value.index() in inplace:  # the same variable as its operand: look further back
        return _shared_sources(op.operand_source(inplace[value.index()]))
    if op.name() == _IF or op.name() in _SHARE:
        return [v for v in _sources(value) if v.id != value.id]
    return []


def _protect_shared_results(program, result: PassResult) -> None:
    """An in-place write into an if's result (or a share_data_ result) writes the buffer of the
    value the branch yielded: the executor shares it, and orders nothing against that value's other
    readers. With static semantics that value keeps its own: the write gets a copy to work on, and
    the reads after it (of the same variable) read the write's result."""
    idx = _Index(program)
    for op_id, op in list(idx.op_of.items()):
        inplace = _inplace_map(op)
        if not inplace or op.num_regions() > 0:
            continue
        for out_pos, in_pos in sorted(inplace.items()):
            target = op.operand_source(in_pos)
            if not _shared_sources(target):
                continue
            later = [u for u in target.all_used_ops() if u.id() != op.id() and idx.after(u, op)]
            op.operand(in_pos).set_source(_fresh_copy(target, op))
            for user in later:
                for pos in _positions(user, target):
                    user.operand(pos).set_source(op.result(out_pos))
            result.copies_inserted += 1
            idx = _Index(program)


def _rewire_reads_after(idx: _Index, loop, j: int) -> int:
    value, res = loop.operand_source(j + 1), loop.result(j)
    moved = 0
    for user in _reads_after(idx, value, loop):
        for pos in _positions(user, value) - _aliased_operands(user):  # reads only, not writes
            user.operand(pos).set_source(res)
            moved += 1
    return moved


def _copy_yielded(info: _Loop, k: int) -> None:
    yield_op = info.body.ops[-1]
    yield_op.operand(k + 1).set_source(_fresh_copy(info.yielded[k], yield_op))


def prune_copies(program, semantics: str, result: PassResult, outputs: Optional[Sequence[object]] = None) -> None:
    """Drop copies protect_inplace_writes inserted that later passes made unnecessary."""
    fetched = None if outputs is None else {v.id for v in outputs}
    for copy in list(result.inserted_ops):
        idx = _Index(program)
        out = copy.result(0)
        users = list(out.all_used_ops())
        if len(users) != 1 or users[0].name() != _WHILE:
            continue
        loop = users[0]
        j = next(iter(_positions(loop, out))) - 1
        source = copy.operand_source(0)
        loop.operand(j + 1).set_source(source)  # as if the copy were not there
        info = _analyse(idx, loop, _nested_clobbers(idx, loop))
        ignore = {copy.id(), copy.operand_source(1).get_defining_op().id()}
        if info is not None and not _copy_needed(_Index(program), info, j, semantics, fetched, ignore):
            _erase_copy(copy)
            result.inserted_ops.remove(copy)
            result.copies_inserted -= 1
        else:
            loop.operand(j + 1).set_source(out)


def _nested_clobbers(idx: _Index, loop) -> Dict[int, Set[int]]:
    """all_clobbers for the loops inside loop, less operands that are private copies."""
    clobbers: Dict[int, Set[int]] = {}
    for inner in idx.loops:
        if inner.id() == loop.id() or not idx.inside(inner, loop):
            continue
        info = _analyse(idx, inner, clobbers)
        if info is None:
            clobbers[inner.id()] = set(range(inner.num_operands() - 1))
        else:
            clobbers[inner.id()] = {j for j in info.clobbered() if not _is_copy(inner.operand_source(j + 1))}
    return clobbers


def _is_fresh_copy(op) -> bool:
    """op is a copy into a buffer of its own, as _fresh_copy builds it."""
    if op.name() != _COPY:
        return False
    buffer_op = op.operand_source(1).get_defining_op()
    return buffer_op is not None and buffer_op.name() == "pd_op.empty_like" and len(op.operand_source(1).all_used_ops()) == 1


def _is_copy(value) -> bool:
    """value is a private copy (a safety copy, or an assign) that only its loop uses."""
    op = value.get_defining_op()
    if op is None or len(value.all_used_ops()) != 1:
        return False
    return op.name() == "pd_op.assign" or _is_fresh_copy(op)


# -- remove_loop_carried_copies -------------------------------------------------------------------------

def _fresh_body_value(idx: _Index, value, anchor) -> bool:
    """value is computed in the same block as anchor by a plain op and is not persistable."""
    op = value.get_defining_op()
    return (
        op is not None
        and idx.same_block(op, anchor)
        and _is_plain(op)
        and not value.persistable
    )


def _outer_slot_unobserved(idx: _Index, loop, k: int, depth: int = 0) -> bool:
    """Nothing can see loop's operand for slot k change once the loop has started (eager semantics)."""
    if depth > 64:
        return False
    outer = loop.operand_source(k + 1)
    if outer.persistable or _count(loop.operands_source(), outer) != 1:
        return False
    for user in outer.all_used_ops():
        if user.id() == loop.id():
            continue
        if idx.after(user, loop) or not _reads_only(user, outer):
            return False
    producer = outer.get_defining_op()
    if producer is not None:
        # Defined in the loop's own block, so an enclosing loop recomputes it every iteration.
        if not idx.same_block(producer, loop):
            return False
        return _is_plain(producer) or _is_fresh_copy(producer)
    owner = idx.arg_owner.get(outer.id)
    if owner is None:
        return False
    enclosing, block, j = owner
    if enclosing.name() != _WHILE or _count(loop.get_parent_block().args(), outer) != 1:
        return False
    # From the second iteration on the argument holds what the enclosing loop yielded in slot j;
    # that must be a fresh value, not a buffer still shared with something live.
    yield_op = block.ops[-1]
    if yield_op.name() != _YIELD or yield_op.num_operands() != len(block.args()) + 1:
        return False
    yielded = yield_op.operand_source(j + 1)
    if not _fresh_body_value(idx, yielded, yield_op) or _count(yield_op.operands_source(), yielded) != 1:
        return False
    return _outer_slot_unobserved(idx, enclosing, j, depth + 1)


def _removable(idx: _Index, copy, semantics: str, clobbers: Dict[int, Set[int]]) -> Optional[object]:
    """The value to use instead of copy's result, or None when the copy must stay."""
    body = copy.get_parent_block()
    loop = body.parent_op
    if loop is None or loop.name() != _WHILE or len(body.kwargs()) != 0:
        return None
    args = body.args()
    if loop.num_operands() != len(args) + 1 or loop.num_results() != len(args):
        return None
    src, dst = copy.operand_source(0), copy.operand_source(1)
    result = copy.result(0)
    k = next((i for i, a in enumerate(args) if a.id == dst.id), None)
    if k is None:
        return None
    yield_op = body.ops[-1]
    if yield_op.name() != _YIELD or yield_op.num_operands() != len(args) + 1:
        return None
    yielded = yield_op.operands_source()
    if yielded[k + 1].id != result.id or _count(yielded, result) != 1:
        return None

    # The result: yielded in slot k and otherwise only read.
    for user in result.all_used_ops():
        if user.id() != yield_op.id() and not _reads_only(user, result):
            return None

    # The block argument: nothing after the copy reads it or an alias of it. (Writes before the
    # copy are overwritten by it; without it they land in a buffer nothing reads afterwards, or,
    # in the first iteration, in the operand's: the safety pass's business, or eager's meaning.)
    for alias in _forward_aliases(dst, skip_op=copy):
        for user in alias.all_used_ops():
            if user.id() != copy.id() and idx.after(user, copy):
                return None

    # The source: fresh, local, yielded nowhere else, never written in place or handed to
    # another op that may share its buffer.
    if not _fresh_body_value(idx, src, copy) or _count(yielded, src) != 0:
        return None
    for user in src.all_used_ops():
        if user.id() != copy.id() and not _reads_only(user, src):
            return None

    if semantics == "eager" and not _outer_slot_unobserved(idx, loop, k):
        return None
    return src


def _gc_enabled() -> bool:
    try:
        flag = paddle.get_flags(["FLAGS_eager_delete_tensor_gb"])["FLAGS_eager_delete_tensor_gb"]
    except Exception:
        return False
    return float(flag) >= 0.0


def remove_loop_carried_copies(program, semantics: str = "static", result: Optional[PassResult] = None,
                               outputs: Optional[Sequence[object]] = None) -> PassResult:
    """Remove redundant loop-carried ``pd_op.assign_out_`` copies from a PIR program, in place.

    Walks every block, nested while bodies included; see the module docstring for when a copy goes.
    """
    _check(program, semantics)
    result = result or PassResult()
    if not _gc_enabled():
        return result
    # Each removal is checked against the program as it is at that moment, so removing an outer
    # copy may make an inner one removable; re-index after every change until nothing moves.
    while True:
        idx = _Index(program)
        clobbers = all_clobbers(idx)
        for copy in idx.copies:
            src = _removable(idx, copy, semantics, clobbers)
            if src is not None:
                copy.result(0).replace_all_uses_with(src)
                copy.erase()
                result.copies_removed += 1
                break
        else:
            return result


def _check(program, semantics: str) -> None:
    if not isinstance(program, paddle.pir.Program):
        raise TypeError(f"expected a PIR program (paddle.pir.Program), got {type(program).__name__}")
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics={semantics!r}: must be one of {', '.join(SEMANTICS)}")


PROGRAM_PASSES: Dict[str, Callable[..., PassResult]] = {
    "protect_inplace_writes": protect_inplace_writes,
    "remove_loop_carried_copies": remove_loop_carried_copies,
}


def run_passes(program, names: Sequence[str], semantics: str = "static",
               outputs: Optional[Sequence[object]] = None) -> PassResult:
    """Run the named passes on program, in order, then drop safety copies later passes made moot."""
    names = list(names)
    for name in names:
        if name not in PROGRAM_PASSES:
            raise ValueError(
                f"unknown program pass {name!r}; known passes: {', '.join(sorted(PROGRAM_PASSES))}"
            )
    _check(program, semantics)
    result = PassResult()
    # New ops (the safety copies) are built as PIR ops even when called from dygraph code (the
    # plugin runs passes on SOT's programs at their first run).
    with paddle.base.framework._dygraph_guard(None), paddle.pir.core.program_guard(program):
        for name in names:
            PROGRAM_PASSES[name](program, semantics, result, outputs)
        if result.inserted_ops:
            prune_copies(program, semantics, result, outputs)
    return result
