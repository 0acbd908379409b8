"""Process B, torch side: model runner, batch building, attention metadata, CUDA graphs, sampler."""
