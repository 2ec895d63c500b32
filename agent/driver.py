"""The node's one VM driver instance, created on first use from settings, and its cache
of booted templates (``vmm.templates``).

Why a holder: tasks run on many worker threads and must share one driver (it owns
port allocation and state dirs); unit tests swap in a stub with `set_driver`.
"""
import threading

from django.conf import settings

_driver = None
_lock = threading.Lock()


def get_driver():
    global _driver
    with _lock:
        if _driver is None:
            from vmm.driver import get_driver as make_driver

            _driver = make_driver(
                settings.AENV_DRIVER,
                home=settings.AENV_HOME,
                images_dir=settings.AENV_IMAGES_DIR,
                host_address=settings.AENV_NODE_ADDRESS,
                **(_qemu_options() if settings.AENV_DRIVER == "qemu" else {}),
            )
        return _driver


def _qemu_options() -> dict:
    from vmm.net.conntrack import GuestLimits  # noqa: PLC0415 - checks the limits (LimitsError at node start)
    from vmm.qemu.iolimits import DiskLimits  # noqa: PLC0415 - refuses negative limits at node start

    limits = GuestLimits(settings.AENV_NET_CT_MAX_PER_SANDBOX, settings.AENV_NET_CT_NEW_RATE,
                         settings.AENV_NET_CT_NEW_BURST)
    from vmm.net.dns import DNSLimits  # noqa: PLC0415 - checks the limits (ValueError at node start)

    dns_limits = DNSLimits(settings.AENV_NET_DNS_RATE, settings.AENV_NET_DNS_BURST,
                           settings.AENV_NET_DNS_TCP_CONNECTIONS, settings.AENV_NET_DNS_FORWARD_MAX)
    return {"net_limits": limits, "net_dns_limits": dns_limits, "boot_timeout": settings.AENV_BOOT_TIMEOUT, "network": settings.AENV_NETWORK,
            "net_prefix": settings.AENV_NET_PREFIX, "net_pool": settings.AENV_NET_POOL,
            "net_warm": settings.AENV_NET_WARM_SLOTS, "net_deny_extra": settings.AENV_NET_DENY_EXTRA,
            "net_allow_extra": settings.AENV_NET_ALLOW_EXTRA, "net_ingress_from": settings.AENV_NET_INGRESS_FROM,
            "shm_headroom_mb": settings.AENV_SHM_HEADROOM_MB, "shm_dir": settings.AENV_SHM_DIR, "warm_ram_copies": settings.AENV_WARM_RAM_COPIES,
            "disk_limits": DiskLimits(bps=settings.AENV_DISK_BPS_MAX_MB << 20, iops=settings.AENV_DISK_IOPS_MAX),
            "net_egress_options": _egress_options()}


def _egress_options() -> dict:
    """What the node's egress proxy needs for network.rules: the node's CA (its key too: the
    proxy signs intercepted hosts' certificates with it), how to ask the API for secret values
    (and egress proxy passwords), the CA bundle upstream servers are verified against (None:
    the public CAs), and whether a sandbox's upstream proxy may be a private address."""
    from agent import egress_secrets, egress_trust  # noqa: PLC0415 - Django-side helpers, used at driver start

    return {"ca_pem": egress_trust.node_ca().mitmproxy_pem(), "secrets": egress_secrets.proxy_config(),
            "upstream_ca": settings.AENV_EGRESS_UPSTREAM_CA,
            "allow_private_upstream": settings.AENV_EGRESS_PROXY_ALLOW_PRIVATE}


def get_templates():
    """The booted templates of this node's images dir (cheap: a path, read per lookup)."""
    from vmm.templates import TemplateCache  # noqa: PLC0415

    return TemplateCache(settings.AENV_IMAGES_DIR)


def set_driver(driver) -> None:
    """Replace the driver (unit tests); None resets to the settings-built one."""
    global _driver
    with _lock:
        _driver = driver
