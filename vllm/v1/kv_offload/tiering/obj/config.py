"""Connection settings of the object-store tier (upstream v0.33's ``tiering.obj.config``)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Settings passed to NIXL only when set: left out, the AWS SDK under NIXL's OBJ plugin finds
# credentials and region itself (IAM role, environment, credentials file, Kubernetes workload
# identity).
_OPTIONAL_PARAMS = ("access_key", "secret_key", "session_token", "region", "ca_bundle")


@dataclass
class ObjStoreConfig:
    """Where the bucket is and how to reach it; the tier config's ``store_config`` dict holds
    these fields. Secrets stay out of ``repr``."""

    bucket: str
    endpoint_override: str
    access_key: str = field(default="", repr=False)
    secret_key: str = field(default="", repr=False)
    session_token: str = field(default="", repr=False)
    region: str = ""
    scheme: str = "http"
    ca_bundle: str = ""

    def to_nixl_params(self) -> dict[str, str]:
        """The OBJ backend parameters: bucket, endpoint and scheme, plus each optional
        setting that is not empty."""
        params = {
            "bucket": self.bucket,
            "endpoint_override": self.endpoint_override,
            "scheme": self.scheme,
        }
        params.update({name: v for name in _OPTIONAL_PARAMS if (v := getattr(self, name))})
        return params
