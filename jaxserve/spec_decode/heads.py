"""Draft heads on the target's own hidden states: Medusa and EAGLE, and their checkpoints.

Both read `h_t`, the target's last-layer output at position t before the final norm
(`DecoderLM.hidden_states`), and both end in the target's own `logits` (final norm and LM
head, frozen and shared, never copied), so a head holds only its few new parameters.

    Medusa:  head j:  h_t -> h_t + SiLU(W_j h_t + b_j) -> target.logits -> x_{t+j+2}
    EAGLE:   (h_i, x_{i+1}) for i <= t -> fc -> one DecoderLayer -> f_{t+1} -> target.logits -> x_{t+2}
             drafting feeds f_{t+1} and its token back in: (f_{t+1}, d_1) -> f_{t+2} -> d_2 ...

The target itself predicts x_{t+1} from h_t. A Medusa block starts at W = 0, b = 0, so an
untrained head j repeats the target's next-token guess. EAGLE's layer is the serving
model's `DecoderLayer` run by the model's own paged-attention step (`model._layer`) over a
one-layer KV cache, so training and drafting attend exactly as serving does.

NOTE: training differentiates through attention, and the serving reference
(`ragged_paged_attention_reference`) cannot be: it loops over only the real tiles, with
loop bounds that depend on the data, which reverse mode refuses. `trainable_attention`
below has its signature and semantics (paged K/V, ragged causal queries) in a form
`jax.grad` accepts; drafting and evaluation keep the reference.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder import AttentionFn, DecoderLayer, DecoderLM, RMSNorm, _layer
from jaxserve.model.inputs import ModelInputs
from jaxserve.model.kv_cache import KVCache, allocate_kv_cache
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

METHODS = ("medusa", "eagle")


class MedusaBlock(nnx.Module):
    """h + SiLU(W h + b), W and b zero at first: the identity until trained."""

    def __init__(self, dim: int, dtype, rngs: nnx.Rngs):
        self.linear = nnx.Linear(
            dim,
            dim,
            dtype=dtype,
            param_dtype=dtype,
            kernel_init=nnx.initializers.zeros,
            bias_init=nnx.initializers.zeros,
            rngs=rngs,
        )

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + jax.nn.silu(self.linear(h))


class MedusaHeads(nnx.Module):
    """k residual blocks on h_t; head j's logits guess the token at t + j + 2."""

    def __init__(self, cfg: ModelConfig, num_heads: int, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if num_heads < 1:
            raise ValueError(f"{num_heads=} must be at least 1")
        self.num_heads = num_heads
        self.blocks = nnx.List([MedusaBlock(cfg.hidden_size, dtype, rngs) for _ in range(num_heads)])

    def __call__(self, target: DecoderLM, h: jax.Array) -> jax.Array:
        """f32 logits [k, T, V] of hidden states h [T, D]."""
        return jnp.stack([target.logits(block(h)) for block in self.blocks])


def head_config(cfg: ModelConfig) -> ModelConfig:
    """An EAGLE head's config from its target's: one layer (its KV cache has one), in full
    precision (the target checkpoint's calibrated KV scales are not the head's)."""
    return dataclasses.replace(cfg, num_layers=1, kv_scales=None)


class EagleHead(nnx.Module):
    """fc(concat[feature, embedding of the next token]) and one decoder layer of the target's shape."""

    feature_layers: tuple[int, ...] = ()  # the target layers whose inputs it reads (none: the last hidden state)

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.cfg = head_config(cfg)
        self.fc = nnx.Linear(2 * d, d, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layer = DecoderLayer(self.cfg, dtype, rngs)

    def allocate_kv(self, num_blocks: int, block_size: int) -> KVCache:
        return allocate_kv_cache(self.cfg, num_blocks, block_size, self.fc.kernel.dtype)

    def __call__(
        self,
        target: DecoderLM,
        features: jax.Array,
        next_ids: jax.Array,
        inputs: ModelInputs,
        kv: KVCache,
        attention: AttentionFn = ragged_paged_attention_reference,
    ) -> tuple[jax.Array, KVCache]:
        """The next features [T, D] from features [T, D] and the tokens that follow them
        (`next_ids` [T], at `inputs.positions`), and the cache with these tokens' K/V."""
        x = self.fc(self._fc_input(features, target.embed_tokens(next_ids)))
        inv_freq = jnp.asarray(self.cfg.rope_inv_freq())
        x, kv, _ = _layer((x, kv, jnp.int32(0)), self.layer, inputs, inv_freq, attention)
        return x, kv

    def target_features(self, target: DecoderLM, hidden: jax.Array) -> jax.Array:
        """The features the head reads of the target's hidden states (before its final norm)."""
        return hidden

    def logits(self, target: DecoderLM, features: jax.Array) -> jax.Array:
        """Float32 logits of the head's output features."""
        return target.logits(features)

    def draft_ids(self, target: DecoderLM, features: jax.Array) -> jax.Array:
        """int32 [R]: the target's tokens the head's output features guess (greedy)."""
        return jnp.argmax(self.logits(target, features), axis=-1).astype(jnp.int32)

    def _fc_input(self, features: jax.Array, embeddings: jax.Array) -> jax.Array:
        return jnp.concatenate([features, embeddings], axis=-1)


class Eagle3Head(EagleHead):
    """EAGLE-3: its features are the inputs of a few target layers side by side, brought to
    D by `fc`; its one layer attends over [norm(embedding of the next token); norm(feature)]
    (q/k/v read 2D) and adds attention to the feature (`norm_before_residual`: to the normed
    one); its own norm and LM head score a draft vocabulary, whose token i is the target's
    i + draft_offsets[i]. Its output before that norm is the next feature, without fc."""

    def __init__(
        self,
        cfg: ModelConfig,
        feature_layers: tuple[int, ...],
        draft_vocab_size: int,
        norm_before_residual: bool = False,
        own_embeddings: bool = False,
        dtype=jnp.float32,
        *,
        rngs: nnx.Rngs,
    ):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = head_config(cfg)
        self.feature_layers = tuple(sorted(feature_layers))
        self.norm_before_residual = norm_before_residual
        self.fc = nnx.Linear(len(self.feature_layers) * d, d, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layer = DecoderLayer(self.cfg, dtype, rngs)
        attn = self.layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            out = getattr(attn, name).kernel.shape[1]
            setattr(
                attn,
                name,
                nnx.Linear(2 * d, out, use_bias=cfg.attention_bias, dtype=dtype, param_dtype=dtype, rngs=rngs),
            )
        self.hidden_norm = RMSNorm(d, eps, dtype)
        self.norm = RMSNorm(d, eps, dtype)
        self.lm_head = nnx.Linear(d, draft_vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.draft_offsets = nnx.Variable(jnp.zeros(draft_vocab_size, jnp.int32))
        # Embeddings of its own where its file holds them (vLLM's choice), else it reads the target's.
        self.embed_tokens = (
            nnx.Embed(cfg.vocab_size, d, dtype=dtype, param_dtype=dtype, rngs=rngs) if own_embeddings else None
        )

    def __call__(self, target, features, next_ids, inputs, kv, attention=ragged_paged_attention_reference):
        embed = target.embed_tokens if self.embed_tokens is None else self.embed_tokens
        embeddings = self.layer.input_layernorm(embed(next_ids))
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        inv_freq = jnp.asarray(self.cfg.rope_inv_freq())
        x = jnp.concatenate([embeddings, normed], axis=-1)
        out, kv = self.layer.self_attn(x, inputs, kv, jnp.int32(0), inv_freq, attention)
        x = residual + out
        return x + self.layer.mlp(self.layer.post_attention_layernorm(x)), kv

    def target_features(self, target: DecoderLM, hidden: jax.Array) -> jax.Array:
        """`hidden`: the feature layers' inputs [T, n * D] (ModelRunner.step_features)."""
        return self.fc(hidden)

    def logits(self, target: DecoderLM, features: jax.Array) -> jax.Array:
        """Float32 logits over the draft vocabulary."""
        return self.lm_head(self.norm(features)).astype(jnp.float32)

    def draft_ids(self, target: DecoderLM, features: jax.Array) -> jax.Array:
        guess = jnp.argmax(self.logits(target, features), axis=-1).astype(jnp.int32)
        return guess + self.draft_offsets[...][guess]


def trainable_attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    query_start_loc,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    **unsupported,
) -> jax.Array:
    """`ragged_paged_attention_reference` for training: every token attends over its whole
    gathered context in one masked softmax (no data-dependent loops, so differentiable).
    Memory is T x context, fine for training batches, not for serving."""
    if any(v is not None for v in unsupported.values()):
        raise ValueError(f"trainable_attention does not support {sorted(unsupported)}")
    q, k_pages, v_pages, kv_lens, block_tables, query_start_loc = map(
        jnp.asarray, (q, k_pages, v_pages, kv_lens, block_tables, query_start_loc)
    )
    t, h, dh = q.shape
    s, kvh = kv_lens.shape[0], k_pages.shape[2]
    tok = jnp.arange(t)
    seq = jnp.minimum(jnp.searchsorted(query_start_loc[1:], tok, side="right"), s - 1)  # [T]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    pos = kv_lens[seq] - q_lens[seq] + tok - query_start_loc[seq]  # [T]
    valid = tok < query_start_loc[-1]
    k = k_pages[block_tables].reshape(s, -1, kvh, dh)[seq].astype(jnp.float32)  # [T, C, KV, Dh]
    v = v_pages[block_tables].reshape(s, -1, kvh, dh)[seq].astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(t, kvh, h // kvh, dh) * sm_scale
    scores = jnp.einsum("tkgd,tckd->tkgc", qg, k)
    key = jnp.arange(k.shape[1])[None, :]
    mask = (key <= pos[:, None]) & (key < kv_lens[seq][:, None]) & valid[:, None]  # [T, C]
    if sliding_window is not None:
        mask &= key > pos[:, None] - sliding_window
    p = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -jnp.inf), axis=-1)
    p = jnp.where(mask[:, None, None], p, 0.0)  # padding rows: all-masked softmax is NaN
    return jnp.einsum("tkgc,tckd->tkgd", p, v).reshape(t, h, dh).astype(q.dtype)


def make_heads(method: str, cfg: ModelConfig, num_heads: int, dtype=jnp.float32, seed: int = 0):
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    rngs = nnx.Rngs(seed)
    return MedusaHeads(cfg, num_heads, dtype, rngs=rngs) if method == "medusa" else EagleHead(cfg, dtype, rngs=rngs)


def prefill_inputs(lengths: list[int], seq_len: int, block_size: int = 1) -> ModelInputs:
    """A prefill of len(lengths) sequences, each padded to `seq_len` tokens on the flat axis
    (T = S * seq_len, so every batch of that shape shares one program). Sequence s owns
    blocks 1 + s * blocks_per_seq ...; its padding tokens are ordinary tokens after its real
    ones, which causality keeps from touching them; callers mask them out of any loss."""
    s = len(lengths)
    per_seq = -(-seq_len // block_size)
    tables = 1 + np.arange(s * per_seq).reshape(s, per_seq)
    pos = np.tile(np.arange(seq_len), s)
    slots = tables[np.repeat(np.arange(s), seq_len), pos // block_size] * block_size + pos % block_size
    starts = np.arange(s + 1) * seq_len
    return ModelInputs.from_numpy(
        input_ids=np.zeros(s * seq_len),
        positions=pos,
        slot_mapping=slots,
        query_start_loc=starts,
        seq_lens=np.full(s, seq_len),
        block_tables=tables,
        logits_indices=starts[1:] - 1,
    )


def save_heads(folder: str | Path, heads: nnx.Module, info: dict) -> None:
    """Parameters with orbax (as the weight cache stores converted weights) and `info.json`
    beside them: method, num_heads, the target's config and source, the training settings."""
    import orbax.checkpoint as ocp

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp.resolve() / "params", nnx.to_pure_dict(nnx.state(heads, nnx.Param)))
    (tmp / "info.json").write_text(json.dumps(info, indent=1, default=str))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def load_heads(
    folder: str | Path, cfg: ModelConfig, dtype=jnp.float32, method: str | None = None
) -> tuple[nnx.Module, dict]:
    """The heads saved in `folder` (or in its `heads`: train_draft's output folder) for a
    target of config `cfg`, and their info; `method`: the kind they must be."""
    import orbax.checkpoint as ocp

    folder = Path(folder).expanduser()
    if (folder / "heads" / "info.json").is_file():
        folder = folder / "heads"
    if not (folder / "info.json").is_file():
        raise ValueError(f"{folder} holds no draft heads (python -m jaxserve.train_draft saves them)")
    info = json.loads((folder / "info.json").read_text())
    if method is not None and info["method"] != method:
        raise ValueError(f"{folder} holds {info['method']} heads, not {method} ones")
    if info["target_config"]["hidden_size"] != cfg.hidden_size or info["target_config"]["vocab_size"] != cfg.vocab_size:
        raise ValueError(f"the heads in {folder} were trained for another target ({info['target_source']})")
    abstract = nnx.eval_shape(lambda: make_heads(info["method"], cfg, info["num_heads"], dtype))
    graphdef, state = nnx.split(abstract)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(folder.resolve() / "params", target)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state), info
