"""Kubernetes operator for `LLMService` resources (group serving.lockstep.dev, version v1alpha1).

Layers, each importing only the ones above it:
  constants, config   names and the operator's one settings dataclass
  inpod               the programs engine pods run (launch.py, fetch.py), their text for the ConfigMap
  spec                LLMService spec -> validated ServiceSpec (pure)
  names               object names, labels, selectors, metadata (pure)
  pods                ServiceSpec -> a group's StatefulSet and pod template (pure)
  builders            ServiceSpec -> Services, NetworkPolicies, PDB, ConfigMap, Secret (pure)
  groups              observed groups and pods: readiness, lost members, why pods do not run (pure)
  conditions          groups -> status conditions (pure)
  plan                observed objects -> actions and status, one named step per rule (pure)
  kube                the Kubernetes API calls that carry a plan out
  handlers, main      kopf wiring, metrics, the `lockstep operator` entry point
"""
