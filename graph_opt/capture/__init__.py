"""Capture: the capture phase of one size (warmups, capture, the check after it), captures at a call,
level 0's capture of the eager forward (whole or split at splitting ops), ranks agreeing on captures,
and what a failed capture says."""
