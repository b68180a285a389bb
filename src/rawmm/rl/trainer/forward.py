"""Forward a packed micro-batch so every sample sees only itself, as if it ran alone.

Packing puts several samples in one row. Two things keep them apart:
- positions restart at 0 for every sample, and
- attention is block-diagonal per sample. transformers builds that mask itself when it gets packed
  position ids and no attention mask (`masking_utils.find_packed_sequence_indices`: a position that
  does not follow its predecessor starts a new sequence), so we pass no mask and no KV cache.

The family's `ForwardPolicy` decides which positions the model gets:
- `pass_position_ids=True` (Kimi): flat per-sample positions `[1, N]`.
- `pass_position_ids=False` (Qwen-VL): no flat positions, because they would replace M-RoPE. The
  model's own `get_rope_index` computes each sample's 3D M-RoPE positions; we stack the per-sample
  text positions on top (`[4, 1, N]`, the layout transformers' Qwen-VL text models accept for
  packed input) so the mask still sees the sample boundaries.

Image pixels arrive as uint8 (the materializer's representation) and are normalized here, after the
move to the model's device, by the materializer's `PixelNormalizer`: a quarter of the bytes cross to
the device, and the float32 pixels exist only for the forward that uses them.

An image used by several samples of a micro-batch (a group's prompt image) is encoded once: given
`image_index`, the kwargs hold each distinct image once and the vision tower's per-image outputs are
repeated to every placeholder span inside the model's own forward (`scattered_image_features`), so
autograd sums an image's gradients over its uses, as separate encodings would.

Only the logits that score a wanted token are computed: given `wanted` (the loss tokens), the model's
`lm_head` runs on the hidden states of the positions that predict them (`logits_to_keep`, inside the
model's own forward, so FSDP gathers the head as usual) instead of on every token. The full-vocabulary
logits of a micro-batch (151,936 columns for Qwen2-VL, in fp32 for the log-softmax) are gigabytes and
their matmul and softmax work for tokens nothing reads: an RL batch's loss tokens are the completions,
a few percent of its tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch

from rawmm.rl.trainer.packing import PackedMicroBatch

if TYPE_CHECKING:
    from rawmm.materialize import ForwardPolicy
    from rawmm.materialize.normalize import PixelNormalizer


def sample_positions(seq_lens: Sequence[int]) -> torch.Tensor:
    """Positions that restart at 0 at each sample start: `[0..a), [0..b), ...` as one `[N]` tensor."""
    return torch.cat([torch.arange(n) for n in seq_lens])


def _rows(values: torch.Tensor, seq_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a packed `[N]` tensor into right-padded `[S, max_len]` rows plus their validity mask."""
    width = max(seq_lens)
    rows = values.new_zeros(len(seq_lens), width)
    mask = torch.zeros(len(seq_lens), width, dtype=torch.long)
    for i, piece in enumerate(torch.split(values, list(seq_lens))):
        rows[i, : len(piece)] = piece
        mask[i, : len(piece)] = 1
    return rows, mask


def mrope_position_ids(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    seq_lens: Sequence[int],
    mm_kwargs: Mapping[str, Any],
) -> torch.Tensor:
    """Per-sample M-RoPE positions of a packed row, from the model's own `get_rope_index`.

    The samples become rows of a padded batch so one call handles them all: `get_rope_index` walks
    the image grids in order across rows, which is exactly the packed image order.
    """
    base: Any = getattr(model, "model", model)  # the model's own attributes: transformers types them loosely
    if not hasattr(base, "get_rope_index"):
        raise TypeError(f"{type(model).__name__} has no get_rope_index; its family must pass position ids")
    ids_rows, mask = _rows(input_ids, seq_lens)
    type_rows, _ = _rows(mm_token_type_ids, seq_lens)
    # Positions are computed on the CPU, beside the token ids: the grids may already be on the model's device.
    rope_kwargs = {k: v.cpu() for k, v in mm_kwargs.items() if k.endswith("grid_thw")}
    positions, _ = base.get_rope_index(ids_rows, type_rows, attention_mask=mask, **rope_kwargs)
    mrope = positions[:, mask.bool()]  # [3, N], back in packed order
    text = sample_positions(seq_lens).to(mrope)
    return torch.cat([text[None], mrope], dim=0)[:, None, :]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
    """`out[j]` = log p(token j | the tokens of its sample before it); 0 at each sample's first token,
    which nothing in its sample predicts. `logits` is `[N, V]`, `input_ids` `[N]`."""
    logprobs = torch.zeros(input_ids.shape[0], dtype=torch.float32, device=logits.device)
    predicted = torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, input_ids[1:, None]).squeeze(-1)
    logprobs[1:] = predicted
    return logprobs.masked_fill(sample_starts(seq_lens).to(logits.device), 0.0)


def wanted_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor, length: int
) -> torch.Tensor:
    """`[length]` logprobs, 0 except at `targets` (indices of tokens, none a sample start), where
    `out[j]` = log p(token j | ...) from `logits[k]`, the logits of position `targets[k] - 1`."""
    predicted = torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[targets][:, None]).squeeze(-1)
    return predicted.new_zeros(length).index_copy(0, targets, predicted)


def sample_starts(seq_lens: Sequence[int]) -> torch.Tensor:
    """Boolean `[N]`: True at the first token of every sample."""
    starts = torch.zeros(sum(seq_lens), dtype=torch.bool)
    starts[torch.tensor([0, *accumulate(seq_lens[:-1])], dtype=torch.long)] = True
    return starts


def _repeat_per_use(output: Any, index: Sequence[int]) -> Any:
    """A vision-tower output of distinct images with its per-image fields repeated per use: the final
    embeddings (`pooler_output`, one tensor per image) and Qwen3-VL's `deepstack_features` (per layer,
    one tensor per image). The concatenated hidden states are dropped: nothing downstream reads them."""
    if not hasattr(output, "pooler_output"):
        raise TypeError(f"get_image_features returned {type(output).__name__}, not per-image outputs")
    output.pooler_output = tuple(output.pooler_output[i] for i in index)
    if getattr(output, "deepstack_features", None) is not None:
        output.deepstack_features = [tuple(layer[i] for i in index) for layer in output.deepstack_features]
    output.last_hidden_state = None
    return output


def encodes_images_once(model: torch.nn.Module) -> bool:
    """Whether `model` takes its vision tower's outputs the way `scattered_image_features` hands them:
    transformers' multimodal models whose forward accepts `mm_encoder_outputs` (per-image outputs of
    `get_image_features`). Others get every span's pixels."""
    base: Any = getattr(model, "model", model)
    forward = getattr(base, "forward", None)
    return (
        hasattr(base, "get_image_features")
        and forward is not None
        and "mm_encoder_outputs" in inspect.signature(forward).parameters
    )


@contextmanager
def scattered_image_features(model: torch.nn.Module, index: Sequence[int]) -> Iterator[None]:
    """Inside, the model's `get_image_features` encodes the distinct images it is given once and hands
    the forward one output per placeholder span (`index[k]`: the image of span k). Patched on the
    instance, within the model's own forward, so FSDP gathers and hooks run as for any forward."""
    base: Any = getattr(model, "model", model)
    if not hasattr(base, "get_image_features"):
        raise TypeError(f"{type(model).__name__} has no get_image_features to encode images once")
    inner = base.get_image_features

    def per_use(*args: Any, **kwargs: Any) -> Any:
        return _repeat_per_use(inner(*args, **kwargs), index)

    base.get_image_features = per_use
    try:
        yield
    finally:
        del base.get_image_features


def forward_logprobs(
    model: torch.nn.Module,
    batch: PackedMicroBatch,
    mm_kwargs: Mapping[str, Any],
    policy: ForwardPolicy,
    *,
    normalizer: PixelNormalizer | None = None,
    temperature: float = 1.0,
    image_index: Sequence[int] | None = None,
    wanted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token logprobs `[N]` of `batch.token_ids` under `model`, packed but per-sample exact.

    `mm_kwargs` are the materialized image tensors of the micro-batch (empty for text only): uint8
    pixels with the `normalizer` that makes them model inputs, or already normalized pixels without;
    one entry per placeholder span, or with `image_index` (the image of each span) each distinct image
    once. `temperature` scales the logits the way the engine did when it sampled. `wanted` (boolean
    `[N]`, e.g. the loss mask): only those tokens' logprobs are computed, the others are 0; the logits
    then exist only at the positions that predict them. None: every token's.
    """
    device = next(model.parameters()).device
    input_ids = torch.tensor(batch.token_ids, dtype=torch.long)
    mm_token_type_ids = torch.tensor(batch.mm_token_type_ids, dtype=torch.long)
    repeats = image_index is not None and list(image_index) != list(range(len(image_index)))
    if policy.pass_position_ids:
        position_ids = sample_positions(batch.seq_lens)[None]
    else:
        per_span = dict(mm_kwargs)
        if image_index is not None:  # positions follow every span's grid (grids: one row per image)
            rows = torch.tensor(list(image_index), dtype=torch.long)
            per_span = {k: v[rows] if k.endswith("grid_thw") else v for k, v in per_span.items()}
        position_ids = mrope_position_ids(model, input_ids, mm_token_type_ids, batch.seq_lens, per_span)
    inputs: dict[str, Any] = {k: v.to(device) for k, v in mm_kwargs.items()}
    if normalizer is not None:
        inputs = normalizer.inputs(inputs)  # the device's uint8 copy is dropped here, before the forward
    elif "pixel_values" in inputs and inputs["pixel_values"].dtype == torch.uint8:
        # The vision tower would cast them to float and run on 0..255: wrong, and silently so.
        raise ValueError("uint8 pixel_values need the materializer's normalizer")
    if policy.requires_mm_token_type_ids:
        inputs["mm_token_type_ids"] = mm_token_type_ids[None].to(device)
    targets = None
    if wanted is not None:  # a sample's first token has no prediction inside its sample
        keep = wanted.cpu().bool() & ~sample_starts(batch.seq_lens)
        targets = torch.nonzero(keep).reshape(-1).to(device)
        if takes_logits_to_keep(model):
            inputs["logits_to_keep"] = targets - 1
    encode_once = scattered_image_features(model, image_index) if repeats and image_index else nullcontext()
    with encode_once:
        logits = model(
            input_ids=input_ids[None].to(device),
            position_ids=position_ids.to(device),
            attention_mask=None,
            use_cache=False,
            **inputs,
        ).logits[0]
    if targets is not None and "logits_to_keep" not in inputs:
        logits = logits[targets - 1]
    if temperature != 1.0:
        logits = logits / temperature
    if targets is not None:
        return wanted_logprobs(logits, input_ids.to(device), targets, len(input_ids))
    return token_logprobs(logits, input_ids.to(device), batch.seq_lens)


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward computes logits only at given positions (`logits_to_keep` as indices:
    transformers' generation-capable models)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters
