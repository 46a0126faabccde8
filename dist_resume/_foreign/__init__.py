"""Layer 3: checkpoint formats other tools write — HF Trainer / Accelerate folders, DCP folders, ``.safetensors``."""
