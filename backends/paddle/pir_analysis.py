"""What the program passes read of a PIR program: which op writes or shares which buffer, where
each op sits, and the while-loop analysis (which slots a loop's body writes, which operand buffers
each block argument may hold). Also PassResult and the argument checks every pass makes.

The executor facts (E1)-(E4) these are built on, and the two semantics, are in passes.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

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


def _check(program, semantics: str) -> None:
    if not isinstance(program, paddle.pir.Program):
        raise TypeError(f"expected a PIR program (paddle.pir.Program), got {type(program).__name__}")
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics={semantics!r}: must be one of {', '.join(SEMANTICS)}")


# -- values a program computes from its inputs' shapes alone -----------------------------------------

_SHAPE_READS = frozenset({"pd_op.numel", "pd_op.shape", "pd_op.shape64"})
_CONSTANTS = frozenset({"pd_op.full", "pd_op.full_int_array"})
# Deterministic ops whose result depends on their operands' values only.
_PURE = frozenset("pd_op." + name for name in (
    "equal", "not_equal", "less_than", "less_equal", "greater_than", "greater_equal", "logical_and",
    "logical_or", "logical_not", "logical_xor", "add", "subtract", "multiply", "divide", "floor_divide",
    "remainder", "maximum", "minimum", "scale", "cast", "slice", "reshape", "squeeze", "unsqueeze", "stack",
    "concat", "abs")) | {"builtin.combine", "builtin.slice", "builtin.split"}


def shape_only_outputs(outputs) -> Tuple[int, ...]:
    """Positions of `outputs` (a program's output values) that it computes from its inputs' shapes alone:
    SOT keeps `x.numel() == 0` a tensor, and a Python branch on it depends on no tensor's data (the
    replay checks each input's shape)."""
    known: Dict[int, bool] = {}

    def shape_only(value, depth: int) -> bool:
        if value.id in known:
            return known[value.id]
        op = value.get_defining_op()
        if op is None or depth > 64:
            result = False
        elif op.name() in _CONSTANTS:
            result = True
        elif op.name() in _SHAPE_READS:  # of an input only: an intermediate's shape may follow data (nonzero)
            source = op.operand_source(0).get_defining_op()
            result = source is not None and source.name() == _DATA
        else:
            result = op.name() in _PURE and op.num_operands() > 0 and all(
                shape_only(op.operand_source(i), depth + 1) for i in range(op.num_operands()))
        known[value.id] = result
        return result

    return tuple(i for i, value in enumerate(outputs) if shape_only(value, 0))
