"""How the shapes environments score an answer: `exact` (the default) or `partial`.

`exact` is the task's verifiable reward: 1.0 when the reply's answer is the target, else 0.0.

`partial` is for policies that (almost) never answer exactly, such as a random-weight demo model or an
early checkpoint: under `exact` every rollout of a group scores 0, the group-normalized advantages
are all 0, and the policy gradient is exactly zero. `partial` keeps the same 1.0 for the exact
answer and otherwise gives a graded score below 1, computed only from the reply and the scene's
answer (still verifiable, deterministic):

    0.5 * closeness(candidate, target) * form(candidate)

- candidate: the word where the task asks for the answer (after `answer`; in the single-image task,
  else the first word) when it has the target's kind, otherwise the first token of the reply that
  has it. Kinds: a number (counts, view numbers), a position on the 3x3 grid, a colour. Only one
  candidate counts, so listing every number earns what the first of them earns.
- closeness: 1 / (1 + d), with d the distance in the answer's own space: |n - target| for numbers,
  the Manhattan distance between cells for positions; colours are either the target (d = 0) or not
  (no credit), since no colour is nearer to red than another. Closeness is 1 only for the target
  itself, written as the target is (`03` for 3 counts as one off).
- form: 1 when the candidate stands where the answer belongs, 1/2 when it was found elsewhere in the
  reply (the answer given in prose rather than in the requested form).

So a near miss is worth at most half an exact answer: the right number in the wrong place 0.25, one
off in the right place 0.25, one off elsewhere 0.125, a reply with nothing of the right kind 0.
"""

from __future__ import annotations

import re

from rawmm.rl.envs.scene import COLOURS, POSITIONS

REWARD_MODES = ("exact", "partial")
_NEAR_MISS = 0.5  # the most a reply that is not exactly right can earn
_ELSEWHERE = 0.5  # the form factor of an answer not given where the task asks for it
_TOKEN = re.compile(r"\d+|[a-z]+(?:-[a-z]+)*")
_CELLS = {name: (row, col) for row, names in enumerate(POSITIONS) for col, name in enumerate(names)}


def check_reward_mode(mode: str) -> str:
    if mode not in REWARD_MODES:
        raise ValueError(f"reward must be one of {', '.join(REWARD_MODES)}, not {mode!r}")
    return mode


def score(mode: str, reply: str, answer: str | None, target: str) -> float:
    """The reward of `reply` under `mode`. `answer` is the normalized word where the task asks for the
    answer (None when the reply gives no answer there); `target` is the correct answer."""
    if answer == target:
        return 1.0
    return partial_credit(reply, answer, target) if mode == "partial" else 0.0


def partial_credit(reply: str, answer: str | None, target: str) -> float:
    """The `partial` score of a reply whose `answer` is not exactly `target` (see the module doc)."""
    if answer is not None and _same_kind(answer, target):
        return _NEAR_MISS * closeness(answer, target)
    for token in _TOKEN.findall(reply.lower()):
        if _same_kind(token, target):
            return _NEAR_MISS * _ELSEWHERE * closeness(token, target)
    return 0.0


def closeness(candidate: str, target: str) -> float:
    """1 / (1 + distance) between two answers of the same kind (1.0 only for the same answer)."""
    if candidate == target:
        return 1.0
    if target.isdecimal():
        return 1.0 / (1.0 + max(1, abs(int(candidate) - int(target))))
    if target in _CELLS:
        (r0, c0), (r1, c1) = _CELLS[candidate], _CELLS[target]
        return 1.0 / (1.0 + abs(r0 - r1) + abs(c0 - c1))
    return 0.0


def _same_kind(candidate: str, target: str) -> bool:
    if target.isdecimal():
        return candidate.isdecimal()
    if target in _CELLS:
        return candidate in _CELLS
    return target in COLOURS and candidate in COLOURS
