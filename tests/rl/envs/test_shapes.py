from __future__ import annotations

import io
import random

import pytest

from rawmm.rl.envs import MultiTurnShapesEnvironment, ShapesEnvironment
from rawmm.rl.envs.scene import COLOURS, Box, Shape, draw, random_panel
from rawmm.rl.envs.shapes import ask, extract_answer, parse_action


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def opening(episode) -> tuple[bytes, str]:
    (message,) = episode.start()
    image_part, text_part = message["content"]
    assert message["role"] == "user" and image_part["type"] == "image" and text_part["type"] == "text"
    return png(image_part["image"]), text_part["text"]


@pytest.mark.parametrize("environment", [ShapesEnvironment(), MultiTurnShapesEnvironment()])
def test_same_seed_same_task_other_seed_other_task(environment):
    assert opening(environment.episode(7)) == opening(environment.episode(7))
    assert environment.episode(7).answer == environment.episode(7).answer
    tasks = {opening(environment.episode(seed)) for seed in range(20)}
    assert len(tasks) == 20


def test_drawn_shapes_sit_where_their_position_says():
    shapes = [
        Shape(kind, colour, 0, row, col)
        for (row, col), kind, colour in zip(
            [(0, 0), (1, 2), (2, 1)], ["circle", "square", "triangle"], ["red", "blue", "yellow"], strict=True
        )
    ]
    image = draw(shapes, Box.panel(0), 120)
    for shape in shapes:
        cx, cy = shape.centre
        # Triangles are fuller below their centre; sample slightly below it.
        assert image.getpixel((int(cx * 120), int(cy * 120) + 4)) == COLOURS[shape.colour]
    assert image.getpixel((60, 60)) != COLOURS["red"]  # the centre cell is empty


def test_questions_have_the_answer_of_the_scene():
    for seed in range(200):
        rng = random.Random(seed)
        shapes = random_panel(rng, 0, min_shapes=1, max_shapes=5)
        question, answer = ask(rng, shapes, views=1)
        if question.startswith("How many shapes"):
            assert answer == str(len(shapes))
        elif question.startswith("How many"):
            colour = question.split()[2]
            assert answer == str(sum(s.colour == colour for s in shapes))
        elif question.startswith("Where is the"):
            colour, kind = question.removeprefix("Where is the ").rstrip("?").split()
            (match,) = [s for s in shapes if (s.colour, s.kind) == (colour, kind)]
            assert answer == match.position
        else:
            kind, position = question.removeprefix("What colour is the ").rstrip("?").split(" at the ")
            (match,) = [s for s in shapes if (s.kind, s.position) == (kind, position)]
            assert answer == match.colour


def test_exact_match_reward_on_the_single_image_task():
    episode = ShapesEnvironment().episode(3)
    right = episode.step(f"Answer: {episode.answer.upper()}.")
    assert (right.reward, right.done, right.messages) == (1.0, True, [])
    assert episode.step(f"{episode.answer}!").reward == 1.0
    assert episode.step(f"maybe {episode.answer}").reward == 0.0
    assert episode.step("").reward == 0.0


def test_extract_answer_and_parse_action():
    assert extract_answer("the answer is: 4, I think") == "4"
    assert extract_answer("Blue") == "blue"
    assert parse_action("let me zoom first") == ("zoom", None)
    assert parse_action("crop bottom-left please") == ("crop", "bottom-left")
    assert parse_action("next, then answer 3") == ("next", None)
    assert parse_action("ANSWER 3") == ("answer", "3")
    assert parse_action("hmm") == ("none", None)


def test_every_action_answers_with_a_new_image_and_answer_ends_it():
    episode = MultiTurnShapesEnvironment(views=3).episode(11)
    seen = [opening(episode)[0]]
    for reply in ("zoom", "crop top-right", "next", "gibberish"):
        result = episode.step(reply)
        assert (result.reward, result.done) == (0.0, False)
        (message,) = result.messages
        image = png(message["content"][0]["image"])
        assert image not in seen, reply
        seen.append(image)
    assert "View 3 of 3" in result.messages[0]["content"][1]["text"]
    final = episode.step(f"answer {episode.answer}")
    assert (final.reward, final.done, final.messages) == (1.0, True, [])


def test_next_cycles_through_the_views():
    environment = MultiTurnShapesEnvironment(views=2)
    episode = environment.episode(5)
    first = opening(episode)[0]
    second = png(episode.step("next").messages[0]["content"][0]["image"])
    back = png(episode.step("next").messages[0]["content"][0]["image"])
    assert first != second and back == first


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="image_size"):
        ShapesEnvironment(image_size=8)
    with pytest.raises(ValueError, match="views"):
        MultiTurnShapesEnvironment(views=0)
