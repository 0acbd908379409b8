"""nn.Modules that hold parameters and call kernels through ``onecard.kernels.dispatch``."""
