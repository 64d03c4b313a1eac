"""The Mixture-of-Experts model types of the llama family's Hugging Face form (models/hf.py,
models/llama.py): `mixtral`, `qwen2_moe`, `qwen3_moe` and `olmoe`, read into and written from a llama with
`model.moe` on. This module holds their config.json keys, both ways, and their tensor names; the
attention side (biases, QK-norm, rotary, windows) stays llama.py's.

How transformers' sparse blocks (5.24: MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock,
Qwen3MoeSparseMoeBlock) map onto ours (models/moe.py, llama.py's MoEBlock):

  router         softmax of x·W_gate in float32 over the E experts, the top-k of those probabilities,
                 renormalised to sum to 1 (Mixtral always; Qwen when `norm_topk_prob`): our
                 routing() with `renormalize`. Dropless, as transformers runs every token-slot:
                 `capacity_factor` null.
  experts        SwiGLU down(silu(gate·x) * up·x): Mixtral's w1 (gate), w3 (up), w2 (down); Qwen's
                 gate_proj, up_proj, down_proj; one (out, in) tensor per expert on disk (what
                 save_pretrained writes: transformers 5 fuses them only in memory).
  shared expert  Qwen2-MoE: shared_expert (a SwiGLU of shared_expert_intermediate_size) scaled by
                 sigmoid(shared_expert_gate·x): `moe.shared_expert_hidden`.
  sparse layers  Qwen's decoder_sparse_step s: layer i is MoE when (i + 1) % s == 0, exactly
                 `moe.every`; its dense layers' intermediate_size must equal moe_intermediate_size
                 (ours share `model.mlp_hidden`). `mlp_only_layers` (dense layers by index) has no
                 form here: refused unless empty.
  aux loss       transformers adds router_aux_loss_coef · load_balancing_loss_func, which pools f and P
                 over the MoE layers and counts f as top-k assignments per token, k times our f
                 (models/moe.py): `load_balance_coef` = router_aux_loss_coef · top_k with
                 `balance_pooling: global`, and no z-loss (`z_loss_coef` 0).

OLMoE (`olmoe`) routes as Qwen3-MoE with every layer MoE and the experts' width intermediate_size;
its q and k RMSNorms span all heads together (`model.qk_norm_scope: all`); `clip_qkv` is refused.

Export picks the type by what the model has: QK-norm over all heads -> olmoe, per head ->
qwen3_moe, a shared expert -> qwen2_moe, else mixtral (every block MoE, renormalised, no biases);
anything else is refused in one line.
The z-loss and capacity have no config.json key: transformers trains without a z-loss and runs
dropless (docs/models.md).
"""

from __future__ import annotations

from models import hf_keys
from models.moe import MoEConfig
from utils.errors import ConfigError

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # Mixtral's names of the SwiGLU matrices

INT, BOOL, LIST, NONNEGATIVE = "a positive integer", "a boolean", "a list", "a number >= 0"
NUMBER = "a positive number"
_Key = hf_keys.Key
_TOP_K = _Key(INT, "experts each token is routed to", required=True)
_COEF = _Key(NONNEGATIVE, "the load-balancing loss' weight", default=0.001)
_QWEN = {  # the keys qwen2_moe and qwen3_moe share
    "num_experts_per_tok": _TOP_K,
    "moe_intermediate_size": _Key(INT, "each expert's SwiGLU width", required=True),
    "norm_topk_prob": _Key(BOOL, "whether the top-k weights are renormalised", default=False),
    "decoder_sparse_step": _Key(INT, "every s-th layer is MoE", default=1),
    "mlp_only_layers": _Key(LIST, "layers kept dense, by index", default=[]),
    "router_aux_loss_coef": _COEF,
}
# config.json keys each MoE type adds to the llama family's (models/hf_keys.py checks each before anything is built)
HF_KEYS = {
    "mixtral": {
        "num_local_experts": _Key(INT, "experts per MoE block", required=True),
        "num_experts_per_tok": _TOP_K,
        "router_aux_loss_coef": _COEF,
        "router_jitter_noise": _Key(NONNEGATIVE, "training-time noise on the router input", default=0.0),
    },
    "qwen2_moe": {
        "num_experts": _Key(INT, "experts per MoE block", required=True),
        **_QWEN,
        "shared_expert_intermediate_size": _Key(INT, "the shared expert's SwiGLU width", required=True),
        "qkv_bias": _Key(BOOL, "biases on q, k and v", default=True),
    },
    "qwen3_moe": {  # transformers 5 saves num_local_experts, the hub's configs num_experts: either (export: both)
        "num_experts": _Key(INT, "experts per MoE block; num_local_experts when null"),
        "num_local_experts": _Key(INT, "experts per MoE block (transformers 5's name); num_experts when null"),
        **_QWEN,
    },
    "olmoe": {
        "num_experts": _Key(INT, "experts per MoE block", required=True),
        "num_experts_per_tok": _TOP_K,
        "norm_topk_prob": _Key(BOOL, "whether the top-k weights are renormalised", default=False),
        "router_aux_loss_coef": _Key(NONNEGATIVE, "the load-balancing loss' weight", default=0.01),
        "clip_qkv": _Key(NUMBER, "q, k and v clamped to [-clip_qkv, clip_qkv]; null = not clamped"),
    },
}


def _unsupported(where: str, key: str, value, why: str) -> ConfigError:
    return ConfigError(f"{where} {key}={hf_keys.json_text(value)}: {why}; eqtrain's MoE blocks cannot represent "
                       "it (pick a checkpoint without it)")


def from_hf(hf: dict, where: str, num_blocks: int, intermediate_size: int) -> dict:
    """The llama Config fields an MoE config.json sets (the module docstring's mapping): `moe`,
    `mlp_hidden` (the experts' width) and `qkv_bias`; one-line ConfigErrors naming `where` and the key."""
    kind = hf["model_type"]
    v = hf_keys.read(hf, HF_KEYS[kind], where)
    experts = v.get("num_local_experts") if kind == "mixtral" else v["num_experts"] or v.get("num_local_experts")
    if experts is None:  # qwen3_moe with neither name
        raise ConfigError(f"{where} num_experts is missing: eqtrain needs it (experts per MoE block) as {INT}, e.g. "
                          "num_experts: 128; save the directory again with transformers' save_pretrained, or add it")
    top_k = v["num_experts_per_tok"]
    if top_k > experts:
        raise ConfigError(f"{where} num_experts_per_tok={top_k} is more than the {experts} experts: each token "
                          "picks distinct experts; correct config.json")
    if kind == "mixtral":
        if v["router_jitter_noise"]:
            raise _unsupported(where, "router_jitter_noise", v["router_jitter_noise"],
                               "the router here takes its input without noise")
        every, renormalize, width, shared = 1, True, intermediate_size, 0
    elif kind == "olmoe":
        if v["clip_qkv"] is not None:
            raise _unsupported(where, "clip_qkv", v["clip_qkv"], "q, k and v here are not clamped")
        every, renormalize, width, shared = 1, v["norm_topk_prob"], intermediate_size, 0
    else:
        if v["mlp_only_layers"]:
            raise _unsupported(where, "mlp_only_layers", v["mlp_only_layers"],
                               "dense layers here are the complement of every decoder_sparse_step-th, not a list")
        every, renormalize, width = v["decoder_sparse_step"], v["norm_topk_prob"], v["moe_intermediate_size"]
        if num_blocks % every:
            raise _unsupported(where, "decoder_sparse_step", every, f"blocks are scanned in groups of "
                               f"decoder_sparse_step, which must divide num_hidden_layers={num_blocks}")
        if every > 1 and width != intermediate_size:
            raise _unsupported(where, "moe_intermediate_size", width, f"with decoder_sparse_step={every} the dense "
                               f"layers' intermediate_size={intermediate_size} must equal it: experts and dense MLPs "
                               "share model.mlp_hidden")
        shared = v.get("shared_expert_intermediate_size", 0)
    moe = MoEConfig(num_experts=experts, top_k=top_k, capacity_factor=None, every=every, renormalize=renormalize,
                    load_balance_coef=float(v["router_aux_loss_coef"]) * top_k, z_loss_coef=0.0,
                    balance_pooling="global", shared_expert_hidden=shared)
    return {"moe": moe, "mlp_hidden": width, "qkv_bias": kind == "qwen2_moe" and v["qkv_bias"]}


def model_type(cfg) -> str:
    """The MoE model type that can hold a llama config with MoE on, or a one-line ConfigError naming
    the knob none of them has."""
    moe = cfg.moe
    if cfg.qk_norm:
        if moe.shared_expert_hidden:
            raise ConfigError(f"model.moe.shared_expert_hidden={moe.shared_expert_hidden} with model.qk_norm=true has "
                              "no Hugging Face form (qwen3_moe has QK-norm and no shared expert, qwen2_moe the "
                              "reverse): export with the default safetensors format")
        if cfg.qk_norm_scope == "all":  # OLMoE's norm over all heads
            if moe.every != 1:
                raise ConfigError(f"model.moe.every={moe.every} with model.qk_norm_scope=all: olmoe (the type with "
                                  "that norm) has no dense blocks: export with the default safetensors format")
            if cfg.head_size is not None:
                raise ConfigError(f"model.head_size={cfg.head_size} with model.qk_norm_scope=all: olmoe's q norm spans "
                                  "hidden_size, so heads must split dim: export with the default safetensors format")
            return "olmoe"
        return "qwen3_moe"
    if moe.shared_expert_hidden:
        return "qwen2_moe"
    why = ("mixtral (no QK-norm, no shared expert) has {what}; qwen2_moe needs model.moe.shared_expert_hidden > 0, "
           "qwen3_moe model.qk_norm=true: export with the default safetensors format")
    if moe.every != 1:
        raise ConfigError(f"model.moe.every={moe.every}: " + why.format(what="no dense blocks"))
    if not moe.renormalize:
        raise ConfigError("model.moe.renormalize=false: " + why.format(what="renormalised top-k weights"))
    if cfg.qkv_bias:
        raise ConfigError("model.qkv_bias=true with MoE: " + why.format(what="no attention biases"))
    return "mixtral"


def hf_config(cfg, kind: str) -> dict:
    """The MoE keys of config.json for model type `kind` (model_type(cfg)). router_aux_loss_coef is
    load_balance_coef / top_k (transformers pools the layers, as balance_pooling global does)."""
    moe = cfg.moe
    out = {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.load_balance_coef / moe.top_k,
           "output_router_logits": False}
    if kind == "olmoe":
        return {**out, "num_experts": moe.num_experts, "norm_topk_prob": moe.renormalize, "clip_qkv": None,
                "attention_bias": False}
    if kind == "mixtral":
        return {**out, "num_local_experts": moe.num_experts, "router_jitter_noise": 0.0, "sliding_window": None}
    out.update(num_experts=moe.num_experts, norm_topk_prob=moe.renormalize, decoder_sparse_step=moe.every,
               mlp_only_layers=[], moe_intermediate_size=cfg.mlp_width, use_sliding_window=False)
    if kind == "qwen2_moe":
        out.update(shared_expert_intermediate_size=moe.shared_expert_hidden, qkv_bias=cfg.qkv_bias,
                   sliding_window=None, max_window_layers=cfg.num_blocks,
                   layer_types=["full_attention"] * cfg.num_blocks)
    else:  # both names of the expert count (HF_KEYS)
        out.update(num_local_experts=moe.num_experts, attention_bias=False, sliding_window=None)
    return out


def tensor_names(naming: str) -> dict[tuple[str, ...], str]:
    """Our MoEBlock's paths (under the block) -> Hugging Face names under `model.layers.{i}.`, for
    `naming` mixtral or qwen; `{e}` stands for the expert. Every one is a torch Linear (out, in): transposed."""
    if naming == "mixtral":
        routed = {("moe", "experts", p, "weight_IxO"): f"block_sparse_moe.experts.{{e}}.{MIXTRAL_EXPERT[p]}.weight"
                  for p in PROJECTIONS}
        return {("moe", "router", "weight_IxO"): "block_sparse_moe.gate.weight", **routed}
    return {("moe", "router", "weight_IxO"): "mlp.gate.weight",
            **{("moe", "experts", p, "weight_IxO"): f"mlp.experts.{{e}}.{p}.weight" for p in PROJECTIONS},
            **{("moe", "shared", p, "weight_IxO"): f"mlp.shared_expert.{p}.weight" for p in PROJECTIONS},
            ("moe", "shared_gate", "weight_IxO"): "mlp.shared_expert_gate.weight"}


def naming_of(tensors, cfg) -> str:
    """Which names a directory's expert tensors use: Mixtral's `block_sparse_moe` or Qwen's `mlp`."""
    first = cfg.moe.layers(cfg.num_blocks)[0]
    return "mixtral" if f"model.layers.{first}.block_sparse_moe.gate.weight" in tensors else "qwen"

