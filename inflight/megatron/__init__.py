"""The Megatron policy worker (`trainer.strategy=megatron`): a megatron-core GPTModel with tensor
parallelism (`worker`), its Hugging Face weight conversion (`convert`), LoRA on its parallel linear
layers (`lora_layers`) and the CPU shim megatron-core runs behind without CUDA (`cpu_shim`).

Above `train` (it builds on train's batches, LoRA settings and losses); train reaches it only
through its entry in `inflight.train.strategies`, by import path."""
