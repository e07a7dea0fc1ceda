"""The node side: what runs on a GPU node beside the kernels (the agent and its helpers).

Mechanisms the agent, the provisioner and ``gpu-lease doctor`` share: parking a kernel's
GPU state (:mod:`.checkpoint`), pid namespaces (:mod:`.pidns`), per-kernel cgroups
(:mod:`.cgroups`) and driver-enforced memory limits (:mod:`.driver_limits`). Nothing here
talks to the broker."""
