"""`ModelConfig`: the architecture of a Llama-family decoder, whatever file it came from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Hugging Face's rope_scaling / rope_parameters (llama3 type supported)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    dtype: str = "float32"  # the checkpoint's own dtype

    @classmethod
    def from_hf_dict(cls, config: dict) -> "ModelConfig":
        heads = config["num_attention_heads"]
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope = config.get("rope_scaling") or None
        params = config.get("rope_parameters") or {}
        theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
        if rope is None and params.get("rope_type", "default") != "default":
            rope = params
        model_type = config.get("model_type", "llama")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            rms_norm_eps=config.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=rope,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", model_type == "qwen2"),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=model_type,
            dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        )

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + head


# Shapes for `random:<shape>`: seeded random weights for tests and benchmarks.
RANDOM_SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=2048,
                        rope_theta=10000.0, eos_token_ids=(2,), bos_token_id=1),
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                                eos_token_ids=(2,), bos_token_id=1),
    "llama-3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                              eos_token_ids=(128001, 128009), bos_token_id=128000, dtype="bfloat16"),
    "llama-3-70b": ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                               num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                               eos_token_ids=(128001, 128009), bos_token_id=128000, dtype="bfloat16"),
}
