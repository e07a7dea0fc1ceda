"""The node side: what runs on a GPU node beside the kernels (the agent and its helpers)."""
