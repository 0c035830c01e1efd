"""Kubernetes operator for `LLMService` resources (group serving.lockstep.dev, version v1alpha1).

Layers, each importing only the ones above it:
  constants, config   names and the operator's one settings dataclass
  spec                LLMService spec -> validated ServiceSpec (pure)
  builders            ServiceSpec -> StatefulSets, Services, ConfigMap (pure)
  plan                observed objects -> actions and status (pure)
  kube                the Kubernetes API calls that carry a plan out
  handlers, main      kopf wiring, metrics, the `lockstep operator` entry point
"""
