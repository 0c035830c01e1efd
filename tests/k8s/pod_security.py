"""The Kubernetes Pod Security Standards, "restricted" profile, as checks on a pod spec.

Written from the standard's list of controls (https://kubernetes.io/docs/concepts/security/pod-security-standards/,
"Baseline" and "Restricted" tables; restricted includes every baseline control). `violations(pod_spec)`
returns one line per broken control, naming it as the standard does, so a test failure says which
rule a manifest breaks. The cluster tests also run pods through the API server's own PodSecurity
admission (namespace label pod-security.kubernetes.io/enforce=restricted).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

# Baseline "Capabilities": what may be added at all; restricted narrows it to NET_BIND_SERVICE.
RESTRICTED_ADDABLE_CAPABILITIES = {"NET_BIND_SERVICE"}
# Restricted "Volume Types".
RESTRICTED_VOLUME_TYPES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip
# Baseline "Sysctls": the safe set.
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
# Baseline "SELinux": allowed types.
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
# Baseline "AppArmor": allowed profile types.
APPARMOR_TYPES = {"RuntimeDefault", "Localhost"}
SECCOMP_TYPES = {"RuntimeDefault", "Localhost"}


def _containers(pod: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from pod.get(key) or []


def violations(pod: Mapping[str, Any]) -> list[str]:
    """Every restricted-profile control the pod spec breaks (empty: it passes)."""
    problems: list[str] = []
    pod_ctx = pod.get("securityContext") or {}

    # --- baseline ---
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            problems.append(f"Host Namespaces: spec.{field} is true")
    if (pod_ctx.get("windowsOptions") or {}).get("hostProcess"):
        problems.append("HostProcess: spec.securityContext.windowsOptions.hostProcess is true")
    for volume in pod.get("volumes") or []:
        if "hostPath" in volume:
            problems.append(f"HostPath Volumes: volume {volume['name']} is a hostPath")
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            problems.append(f"Volume Types: volume {volume['name']} is {sorted(kinds)}")
    for sysctl in pod_ctx.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            problems.append(f"Sysctls: {sysctl.get('name')} is not in the safe set")
    _check_selinux(pod_ctx.get("seLinuxOptions"), "spec.securityContext", problems)
    _check_apparmor(pod_ctx.get("appArmorProfile"), "spec.securityContext", problems)
    _check_seccomp_type(pod_ctx.get("seccompProfile"), "spec.securityContext", problems)
    if pod_ctx.get("runAsUser") == 0:
        problems.append("Running as Non-root user: spec.securityContext.runAsUser is 0")

    for container in _containers(pod):
        where = f"container {container['name']}"
        ctx = container.get("securityContext") or {}
        if ctx.get("privileged"):
            problems.append(f"Privileged Containers: {where} is privileged")
        if (ctx.get("windowsOptions") or {}).get("hostProcess"):
            problems.append(f"HostProcess: {where} sets hostProcess")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                problems.append(f"Host Ports: {where} uses hostPort {port['hostPort']}")
        if ctx.get("procMount", "Default") != "Default":
            problems.append(f"/proc Mount Type: {where} sets procMount {ctx['procMount']}")
        _check_selinux(ctx.get("seLinuxOptions"), where, problems)
        _check_apparmor(ctx.get("appArmorProfile"), where, problems)

        # --- restricted ---
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append(f"Privilege Escalation: {where} does not set allowPrivilegeEscalation: false")
        if not (ctx.get("runAsNonRoot") is True or (pod_ctx.get("runAsNonRoot") is True and ctx.get("runAsNonRoot") is not False)):
            problems.append(f"Running as Non-root: {where} is not runAsNonRoot: true (nor is the pod)")
        if ctx.get("runAsUser") == 0:
            problems.append(f"Running as Non-root user: {where} sets runAsUser 0")
        seccomp = ctx.get("seccompProfile") or pod_ctx.get("seccompProfile")
        if (seccomp or {}).get("type") not in SECCOMP_TYPES:
            problems.append(f"Seccomp: {where} has no RuntimeDefault/Localhost seccomp profile (nor has the pod)")
        _check_seccomp_type(ctx.get("seccompProfile"), where, problems)
        capabilities = ctx.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"Capabilities: {where} does not drop ALL")
        added = set(capabilities.get("add") or []) - RESTRICTED_ADDABLE_CAPABILITIES
        if added:
            problems.append(f"Capabilities: {where} adds {sorted(added)}")
    return problems


def _check_selinux(options: Mapping[str, Any] | None, where: str, problems: list[str]) -> None:
    if not options:
        return
    if options.get("type", "") not in SELINUX_TYPES:
        problems.append(f"SELinux: {where} sets type {options['type']}")
    for field in ("user", "role"):
        if options.get(field):
            problems.append(f"SELinux: {where} sets {field}")


def _check_apparmor(profile: Mapping[str, Any] | None, where: str, problems: list[str]) -> None:
    if profile and profile.get("type") not in APPARMOR_TYPES:
        problems.append(f"AppArmor: {where} sets profile type {profile.get('type')}")


def _check_seccomp_type(profile: Mapping[str, Any] | None, where: str, problems: list[str]) -> None:
    if profile and profile.get("type") == "Unconfined":
        problems.append(f"Seccomp: {where} is Unconfined")


def pod_specs(manifest: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(name, pod spec) of a Pod or of a workload's pod template."""
    kind = manifest.get("kind")
    name = f"{kind}/{manifest['metadata']['name']}"
    if kind == "Pod":
        yield name, manifest["spec"]
    elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        yield name, manifest["spec"]["template"]["spec"]
    elif kind == "CronJob":
        yield name, manifest["spec"]["jobTemplate"]["spec"]["template"]["spec"]
