"""PIR program passes for Paddle static programs.

remove_loop_carried_copies
    Loop state written as ``paddle.assign(new, output=loop_var)`` becomes, in a ``pd_op.while``
    body, ``%r = pd_op.assign_out_(%src, %arg_k)`` followed by ``cf.yield(cond, ..., %r, ...)``:
    one full copy of every carried tensor per iteration. The pass erases the copy and yields
    ``%src`` instead (every use of ``%r`` now reads ``%src``).

Why it is safe. Right after the copy ``%r`` and ``%src`` hold the same data, so the rewrite is
only visible through the buffer the copy writes. The executor shares that buffer along the loop:
the block argument starts on the while operand's buffer, the yield hands it to the while result
and the next iteration, and an inner while's result shares its operand's buffer. A copy goes
only when nothing can see that buffer change and ``%src`` can take its place:

* no op after the copy (nested blocks included) uses ``%arg_k`` or a value that may share its
  buffer, and no other op writes ``%arg_k`` in place;
* ``%src`` is computed in the body by an ordinary op (not in-place, not a view, not control
  flow), is not persistable, is not yielded already, and is only ever read;
* ``%r`` is yielded once, in slot k, and otherwise only read;
* the while operand of slot k is not persistable, is used once by the loop and by nothing after
  the loop starts, and is a fresh value of the loop's own block (or the argument of an enclosing
  while whose own slot passes these checks).

Anything else is left alone. The rewritten loop hands ``%src``'s buffer to the next iteration,
which relies on the executor releasing ``%src``'s variable after the yield (garbage collection,
on by default); with ``FLAGS_eager_delete_tensor_gb < 0`` an op could compute the next ``%src``
into the buffer it reads, so the pass then does nothing. Rewrite a program before its first run:
executors cache compiled programs.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import paddle

_WHILE = "pd_op.while"
_YIELD = "cf.yield"
_COPY = "pd_op.assign_out_"
# Ops that may hand out a buffer they did not allocate without being marked in-place.
_SHARING_NAME_PARTS = ("share", "view", "strided", "unfold", "shadow", "array_read", "data", "feed")


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


def _writes(op, value) -> bool:
    """op itself writes value's buffer (an in-place operand; control flow is followed elsewhere)."""
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
        self.arg_owner: Dict[str, Tuple[object, object, int]] = {}
        self.copies: List[object] = []
        self._walk(program.global_block(), ())

    def _walk(self, block, prefix: Tuple[int, ...]) -> None:
        for i, op in enumerate(block.ops):
            path = prefix + (i,)
            self.pos[op.id()] = path
            if op.name() == _COPY:
                self.copies.append(op)
            for b, sub in enumerate(op.blocks()):
                for k, arg in enumerate(sub.args()):
                    self.arg_owner[arg.id] = (op, sub, k)
                self._walk(sub, path + (b,))

    def after(self, op, ref) -> bool:
        """op runs after ref started: later in program order, or nested inside ref."""
        return self.pos[op.id()] > self.pos[ref.id()]

    def same_block(self, op, ref) -> bool:
        return self.pos[op.id()][:-1] == self.pos[ref.id()][:-1]


def _forward_aliases(value, skip_op) -> List[object]:
    """value plus every value that may share its buffer through ops that use it (except skip_op)."""
    seen = {value.id: value}
    work = [value]
    while work:
        v = work.pop()
        for user in v.all_used_ops():
            if user.id() == skip_op.id():
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
    """Nothing can see loop's operand for slot k change once the loop has started."""
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
        return _is_plain(producer) or producer.name() == "pd_op.data"
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


def _removable(idx: _Index, copy) -> Optional[object]:
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

    # The block argument: nothing after the copy reads it or an alias of it, and nothing else
    # writes it in place.
    for alias in _forward_aliases(dst, skip_op=copy):
        for user in alias.all_used_ops():
            if user.id() == copy.id():
                continue
            if idx.after(user, copy) or _writes(user, alias):
                return None

    # The source: fresh, local, yielded nowhere else, never written in place or handed to
    # another op that may share its buffer.
    if not _fresh_body_value(idx, src, copy) or _count(yielded, src) != 0:
        return None
    for user in src.all_used_ops():
        if user.id() != copy.id() and not _reads_only(user, src):
            return None

    if not _outer_slot_unobserved(idx, loop, k):
        return None
    return src


def _gc_enabled() -> bool:
    try:
        flag = paddle.get_flags(["FLAGS_eager_delete_tensor_gb"])["FLAGS_eager_delete_tensor_gb"]
    except Exception:
        return False
    return float(flag) >= 0.0


def remove_loop_carried_copies(program) -> int:
    """Remove redundant loop-carried ``pd_op.assign_out_`` copies from a PIR program, in place.

    Walks every block, nested while bodies included. Returns the number of copies removed.
    """
    if not isinstance(program, paddle.pir.Program):
        raise TypeError(f"expected a PIR program (paddle.pir.Program), got {type(program).__name__}")
    if not _gc_enabled():
        return 0
    removed = 0
    # Each removal is checked against the program as it is at that moment, so removing an outer
    # copy may make an inner one removable; re-index after every change until nothing moves.
    while True:
        idx = _Index(program)
        for copy in idx.copies:
            src = _removable(idx, copy)
            if src is not None:
                copy.result(0).replace_all_uses_with(src)
                copy.erase()
                removed += 1
                break
        else:
            return removed


PROGRAM_PASSES: Dict[str, Callable[[object], int]] = {
    "remove_loop_carried_copies": remove_loop_carried_copies,
}


def run_passes(program, names: Sequence[str]) -> Dict[str, int]:
    """Run the named passes on program, in order; returns {name: rewrites}."""
    names = list(names)
    for name in names:
        if name not in PROGRAM_PASSES:
            raise ValueError(
                f"unknown program pass {name!r}; known passes: {', '.join(sorted(PROGRAM_PASSES))}"
            )
    return {name: PROGRAM_PASSES[name](program) for name in names}
