"""A call and its replay: the runner that dispatches, pads, copies and replays; call signatures and their
static buffers; each captured size; the outputs a replay hands back (views, shared storage, host copies)."""
