"""Weights in and out: safetensors files in Hugging Face's layout, read straight
into a layout, and LoRA adapters."""

from .load import load_safetensors as load_safetensors
from .lora import (
    LoRALinear as LoRALinear,
    lora as lora,
    lora_trainable as lora_trainable,
    merge_lora as merge_lora,
)
from .save import save_safetensors as save_safetensors
