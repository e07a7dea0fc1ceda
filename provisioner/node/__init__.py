"""Node-side mechanisms the agent and the provisioner share: pid namespaces
(:mod:`.pidns`), per-kernel cgroups (:mod:`.cgroups`) and driver-enforced memory limits
(:mod:`.driver_limits`). Nothing here talks to the broker."""
