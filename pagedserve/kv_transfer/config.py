"""`--kv-transfer-config` (vLLM's JSON shape, fewer fields) and `--kv-offloading-size`."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.json_args import parse_json_object

CONNECTORS = ("cpu", "redis", "directory")
ROLES = ("kv_both", "kv_producer", "kv_consumer")
SAVE_POLICIES = ("evict", "write_through")
DEFAULT_SPILL_SIZE = 10 << 30  # the cpu tier's spill directory, unless disk_size says otherwise
DEFAULT_REDIS_TTL_S = 24 * 3600  # blocks of a model no instance serves any more go away by themselves
FIELDS = {"kv_connector", "kv_role", "kv_buffer_size", "url", "path", "save_policy", "disk_size", "kv_namespace",
          "ttl_s"}


@dataclass(frozen=True)
class KVTransferConfig:
    """Where KV blocks go beyond the pool.

    kv_connector: `cpu` (a second tier in this process: an LRU of host-memory bytes, kv_buffer_size bytes; with
    `path`, what it evicts spills to that directory, disk_size bytes, LRU: a third tier), `redis` (a Redis/Valkey
    server at `url`, shared by instances), `directory` (files under `path`, shared; disk_size bounds them, LRU).
    kv_role: kv_producer only saves, kv_consumer only loads, kv_both does both.
    save_policy: `evict` saves a block when the pool's LRU evicts it (the cheap default of a private tier);
    `write_through` saves every block once written (the default of a shared store: a neighbour may need it now).
    The secret the instances share (each block's HMAC key) is not part of the config, which is logged and
    published: it is the environment variable PAGEDSERVE_KV_TRANSFER_SECRET (pagedserve/envs.py).
    kv_namespace: replaces the digest of the weights in the key namespace (skipping the hashing at start-up): the
    operator vouches that every instance given this name serves the same weights.
    ttl_s: redis only: each block expires this long after it was written (None: never).
    """
    kv_connector: str
    kv_role: str = "kv_both"
    kv_buffer_size: int = 1 << 30
    url: str | None = None
    path: str | None = None
    save_policy: str = "evict"
    disk_size: int | None = None
    kv_namespace: str | None = None
    ttl_s: int | None = DEFAULT_REDIS_TTL_S

    @property
    def loads(self) -> bool:
        return self.kv_role != "kv_producer"

    @property
    def saves(self) -> bool:
        return self.kv_role != "kv_consumer"

    @property
    def is_shared(self) -> bool:
        return self.kv_connector != "cpu"

    @classmethod
    def parse(cls, value: "dict | str | KVTransferConfig | None",
              offloading_size_gib: float | None = None) -> "KVTransferConfig | None":
        """From the JSON/dict form, or `--kv-offloading-size` GiB alone (a cpu tier); ValueError naming the field."""
        if isinstance(value, KVTransferConfig):
            return value
        if value is None:
            if offloading_size_gib is None:
                return None
            value = {"kv_connector": "cpu"}
        value = parse_json_object(value, "kv_transfer_config", FIELDS)
        connector = value.get("kv_connector")
        if connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {list(CONNECTORS)}, got {connector!r}.")
        role = value.get("kv_role", "kv_both")
        if role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {list(ROLES)}, got {role!r}.")
        size = value.get("kv_buffer_size", 1 << 30)
        if offloading_size_gib is not None:
            if connector != "cpu":
                raise ValueError("kv_offloading_size sizes the cpu tier; the kv_connector is " + repr(connector))
            size = int(offloading_size_gib * (1 << 30))
        _check_bytes("kv_buffer_size", size)
        if connector == "redis" and not value.get("url"):
            raise ValueError("kv_transfer_config.url (e.g. redis://127.0.0.1:6379) is required for redis.")
        if connector == "directory" and not value.get("path"):
            raise ValueError("kv_transfer_config.path is required for directory.")
        disk_size = value.get("disk_size")
        if connector == "cpu" and value.get("path") and disk_size is None:
            disk_size = DEFAULT_SPILL_SIZE
        if disk_size is not None:
            _check_bytes("disk_size", disk_size)
            if not value.get("path"):
                raise ValueError("kv_transfer_config.disk_size bounds the files under `path`; path is not set.")
        policy = value.get("save_policy", "evict" if connector == "cpu" else "write_through")
        if policy not in SAVE_POLICIES:
            raise ValueError(f"kv_transfer_config.save_policy must be one of {list(SAVE_POLICIES)}, got {policy!r}.")
        namespace = value.get("kv_namespace")
        if namespace is not None and (not isinstance(namespace, str) or not namespace):
            raise ValueError(f"kv_transfer_config.kv_namespace must be a non-empty string, got {namespace!r}.")
        ttl_s = value.get("ttl_s", DEFAULT_REDIS_TTL_S)
        if "ttl_s" in value and connector != "redis":
            raise ValueError("kv_transfer_config.ttl_s is the expiry of redis keys; the kv_connector is "
                             + repr(connector))
        if ttl_s is not None:
            _check_positive("ttl_s (seconds)", ttl_s)
        return cls(connector, role, size, value.get("url"), value.get("path"), policy, disk_size, namespace, ttl_s)


def _check_bytes(name: str, value: object) -> None:
    _check_positive(f"{name} (bytes)", value)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"kv_transfer_config.{name} must be an integer >= 1, got {value!r}.")
