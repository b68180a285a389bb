"""The `colours` environment: the answer is in the pixels alone, the blind ceiling is 1/K, and the control
(one constant image) hides it."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from rawmm.rl.envs import ColoursEnvironment, load_environment
from rawmm.rl.envs.colours import CONSTANT_FILL, PALETTE, reply_colour


def images(messages):
    return [
        p["image"]
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image"
    ]


def test_the_image_is_the_answer_and_a_right_reply_scores_one():
    env = load_environment("colours", {"colours": 4})
    for seed in range(20):
        episode = env.episode(seed)
        (image,) = images(episode.start())
        assert image.getcolors() == [(56 * 56, PALETTE[episode.answers[0]])]  # flat: one colour, every pixel
        result = episode.step(f" {episode.answers[0].upper()}.")
        assert (result.reward, result.done) == (1.0, True)
        assert episode.outcomes() == [(episode.answers[0], 1.0)]


def test_answers_are_uniform_over_k_colours_so_a_blind_policy_scores_one_over_k():
    env = ColoursEnvironment(colours=4)
    assert env.blind_ceiling == 0.25
    answers = Counter(env.episode(seed).answers[0] for seed in range(4000))
    assert set(answers) == {"red", "green", "blue", "yellow"}
    assert all(abs(n / 4000 - 0.25) < 0.03 for n in answers.values())
    # The best constant reply (what ignoring the pixels amounts to) scores the ceiling, no more.
    best = max(
        sum(env.episode(seed).step(reply).reward for seed in range(4000)) / 4000 for reply in env.names
    )
    assert best == pytest.approx(0.25, abs=0.03)


def test_multi_turn_shows_a_new_image_per_turn_and_pays_its_accuracy():
    env = ColoursEnvironment(colours=4, turns=3)
    episode = env.episode(7)
    messages = episode.start()
    rewards = []
    for turn, reply in enumerate([episode.answers[0], "wrong", episode.answers[2]]):
        result = episode.step(reply)
        rewards.append(result.reward)
        assert result.done == (turn == 2)
        if not result.done:
            (image,) = images(result.messages)
            assert image.getpixel((0, 0)) == PALETTE[episode.answers[turn + 1]]
            messages += [{"role": "assistant", "content": reply}, *result.messages]
    assert len(images(messages)) == 3  # the conversation keeps every earlier image
    assert rewards == pytest.approx([1 / 3, 0.0, 1 / 3])
    assert [score for _, score in episode.outcomes()] == [1.0, 0.0, 1.0]


def test_the_control_shows_one_constant_image_whatever_the_answer():
    env = ColoursEnvironment(colours=4, constant_image=True)
    seen = set()
    for seed in range(40):
        episode = env.episode(seed)
        (image,) = images(episode.start())
        seen.add(image.tobytes())
        assert image.getpixel((0, 0)) == CONSTANT_FILL
    assert len(seen) == 1
    # The answers are still drawn as without the control: the ceiling is the same 1/K.
    assert [env.episode(s).answers for s in range(40)] == [
        ColoursEnvironment(colours=4).episode(s).answers for s in range(40)
    ]


def test_format_examples_are_well_formed_random_answers():
    env = ColoursEnvironment(colours=3)
    rng = random.Random(0)
    replies = Counter(env.format_example(rng) for _ in range(300))
    assert {reply_colour(r) for r in replies} == {"red", "green", "blue"}
    assert all(r == " " + reply_colour(r) for r in replies)


def test_one_word_pays_the_colour_alone_and_keeps_the_ceiling():
    """The run's `one_word: true`: a reply pays only when it is the colour's name alone."""
    env = ColoursEnvironment(colours=4, one_word=True)
    answer = env.episode(3).answers[0]
    for reply, reward in [(f" {answer}", 1.0), (f" {answer.title()}.", 1.0), (f" {answer} {answer}", 0.0),
                          (f" {answer} is it", 0.0), ("", 0.0)]:  # fmt: skip
        assert env.episode(3).step(reply).reward == reward, reply
    assert env.blind_ceiling == 0.25


@pytest.mark.parametrize("args", [{"colours": 1}, {"colours": 99}, {"turns": 0}, {"image_size": 10}])
def test_bad_arguments_are_refused(args):
    with pytest.raises(ValueError):
        ColoursEnvironment(**args)
