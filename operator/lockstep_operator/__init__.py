"""Kubernetes operator for `LLMService` resources (group serving.lockstep.dev, version v1alpha1).

Layers, each importing only the ones above it:
  constants, config   names and the operator's one settings dataclass
  launcher, fetcher   the scripts engine pods run (launch.py, fetch.py), as strings for the ConfigMap
  spec                LLMService spec -> validated ServiceSpec (pure)
  builders            ServiceSpec -> StatefulSets, Services, NetworkPolicies, ConfigMap, Secret (pure)
  groups              observed groups and pods: readiness, lost members, why pods do not run (pure)
  conditions          groups -> status conditions (pure)
  plan                observed objects -> actions and status, one named step per rule (pure)
  kube                the Kubernetes API calls that carry a plan out
  handlers, main      kopf wiring, metrics, the `lockstep operator` entry point
"""
