"""protect_inplace_writes, the safety pass (it runs first), and prune_copies after the other passes.

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

(E1)-(E4) and the two semantics are described in passes.py.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set

import paddle

from .pir_analysis import (
    _IF, _SHARE, _WHILE, PassResult, _Index, _Loop, _aliased_operands, _analyse, _buffer_users, _check,
    _count, _inplace_map, _is_copy, _is_fed, _positions, _reads_after, _shares_buffer_with, _sources,
)


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
                # The copy's ops are new users of the operand (one tensor passed in two slots, say): the
                # next slot's question needs them in the index.
                idx = _Index(program)
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
