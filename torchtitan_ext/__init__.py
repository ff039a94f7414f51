"""Extensions that plug into titanlite only through its public registries and hooks.

- :mod:`torchtitan_ext.qwen3`: a second model family (Qwen3-style dense decoder with QK-norm),
  registered with ``titanlite.models.register_model`` when imported.
- :mod:`torchtitan_ext.qwen3_moe`: Qwen3-MoE (Qwen3's attention with titanlite's MoE layer and expert
  parallelism), registered as ``qwen3_moe``, converting to and from ``Qwen3MoeForCausalLM``.
- :mod:`torchtitan_ext.compat`: run torchtitan's classic TOML train configs and resume from
  torchtitan DCP checkpoints of Llama 3 models.

Core titanlite never imports this package; a run activates an extension with ``[job] extensions``
(see README, "Writing an extension"). Importing this package itself registers nothing.
"""
