from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rawmm.rl.envs import (
    EnvironmentLoadError,
    MultiTurnShapesEnvironment,
    ShapesEnvironment,
    load_environment,
)
from rawmm.rl.envs.rewards import score
from rawmm.rl.envs.scene import COLOURS, POSITIONS
from rawmm.rl.envs.shapes import extract_answer, parse_action

TARGETS = ["3", "0", "12", "red", "yellow", "top-left", "center", "bottom"]


def single(reply: str, target: str, mode: str = "partial") -> float:
    return score(mode, reply, extract_answer(reply), target)


def episode_with(environment, kind):
    """The first episode of `environment` whose answer is a number (`kind="number"`) or a word."""
    for seed in range(200):
        episode = environment.episode(seed)
        if episode.answer.isdecimal() == (kind == "number"):
            return episode
    raise AssertionError(f"no {kind} question in 200 seeds")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mode", ["exact", "partial"])
def test_the_exact_answer_scores_one_in_both_modes(target, mode):
    for reply in (target, f"Answer: {target.upper()}.", f"the answer is {target}, surely"):
        assert single(reply, target, mode) == 1.0


def test_exact_mode_gives_nothing_for_a_near_miss():
    for reply in ("maybe 3", "answer 4", "4", "there are three", ""):
        assert single(reply, "3", "exact") == 0.0


def test_partial_credit_grows_as_the_answer_gets_closer():
    ladder = [
        "no idea",  # nothing of the right kind
        "blah 9",  # far, not where the answer goes
        "answer 9",  # far, in the answer's place
        "blah 4",  # one off, elsewhere
        "answer 4",  # one off, in place
        "answer 3",  # exact
    ]
    scores = [single(reply, "3") for reply in ladder]
    assert scores[0] == 0.0 and scores[-1] == 1.0
    assert scores == sorted(scores) and len(set(scores)) == len(scores), scores
    # The right value given in prose is worth more than a far miss, less than the exact answer.
    assert single("answer 9", "3") < single("I count 3 shapes", "3") < 1.0


def test_positions_are_graded_by_grid_distance_and_colours_only_when_right():
    assert (
        single("bottom-right", "top-left")
        < single("center", "top-left")
        < single("top", "top-left")
        < single("top-left", "top-left")
    )
    assert single("answer blue", "red") == single("nothing here", "red") == 0.0
    assert 0.0 < single("it is red", "red") < 1.0  # the right colour, not as the one-word answer
    assert single("answer 3", "red") == 0.0  # a number is no colour


def test_only_the_first_candidate_counts():
    # Listing every number earns what the first of them earns, not what the best would.
    assert single("1 2 3 4 5 6 7 8 9", "3") == single("1", "3") < single("3", "3")
    assert single("answer 9, no wait, 3", "3") == single("answer 9", "3")


@given(reply=st.text(max_size=60), target=st.sampled_from(TARGETS))
def test_partial_is_a_deterministic_score_in_0_1_that_is_1_only_for_the_exact_answer(reply, target):
    partial = single(reply, target)
    assert 0.0 <= partial <= 1.0
    assert partial == single(reply, target)
    assert (partial == 1.0) == (single(reply, target, "exact") == 1.0)


def test_the_single_image_task_takes_the_reward_mode():
    environment = ShapesEnvironment(reward="partial")
    episode = episode_with(environment, "number")
    near = str(int(episode.answer) + 1)
    assert episode.step(f"answer {near}").reward == single(f"answer {near}", episode.answer) > 0.0
    assert episode.step(episode.answer).reward == 1.0
    assert episode_with(ShapesEnvironment(), "number").step(f"answer {near}").reward == 0.0


def test_a_multiturn_rollout_earns_its_best_attempt():
    episode = episode_with(MultiTurnShapesEnvironment(reward="partial"), "number")
    episode.start()
    target, far = episode.answer, str(int(episode.answer) + 5)
    replies = [f"hmm {far}", "zoom", f"I see {target}", f"next {far}"]
    rewards = [episode.step(reply).reward for reply in replies]
    attempts = [score("partial", reply, None, target) for reply in replies]
    assert all(reward >= 0.0 for reward in rewards)
    assert rewards[1] == rewards[3] == 0.0  # no improvement, no reward
    assert sum(rewards) == pytest.approx(max(attempts)) and 0.0 < max(attempts) < 1.0
    final = episode.step(f"answer {target}")
    assert final.done and sum(rewards) + final.reward == pytest.approx(1.0)


def test_multiturn_exact_mode_pays_only_the_right_answer():
    episode = episode_with(MultiTurnShapesEnvironment(), "number")
    episode.start()
    assert episode.step(f"I see {episode.answer}").reward == 0.0
    assert parse_action(f"answer {episode.answer}") == ("answer", episode.answer)
    assert episode.step(f"answer {episode.answer}").reward == 1.0


def test_answer_kinds_cover_every_question_the_environments_ask():
    kinds = set()
    for environment in (ShapesEnvironment(), MultiTurnShapesEnvironment()):
        for seed in range(300):
            answer = environment.episode(seed).answer
            positions = {p for row in POSITIONS for p in row}
            assert answer.isdecimal() or answer in COLOURS or answer in positions, answer
            kinds.add("number" if answer.isdecimal() else "colour" if answer in COLOURS else "position")
    assert kinds == {"number", "colour", "position"}


@pytest.mark.parametrize("factory", [ShapesEnvironment, MultiTurnShapesEnvironment])
def test_an_unknown_reward_mode_is_refused(factory):
    with pytest.raises(ValueError, match="reward must be one of exact, partial, not 'fuzzy'"):
        factory(reward="fuzzy")
    with pytest.raises(EnvironmentLoadError, match="reward must be one of"):
        load_environment("shapes-multiturn", {"reward": "fuzzy"})
