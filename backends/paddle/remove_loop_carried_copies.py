"""remove_loop_carried_copies: loop-carried copies dropped where nothing can tell.

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

(E1)-(E4) and the two semantics are described in passes.py.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Set

import paddle

from .pir_analysis import (
    _WHILE, _YIELD, PassResult, _Index, _check, _count, _forward_aliases, _is_fresh_copy, _is_plain, _reads_only,
    all_clobbers,
)


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
