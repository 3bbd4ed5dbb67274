"""MooncakeConfig: values from overrides, a mapping and upstream-named environment variables;
wrong values get clear errors (no Mooncake process needed)."""

from __future__ import annotations

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.config import (
    ENV_VARS,
    MooncakeConfig,
    parse_size_bytes,
)


def test_defaults_stay_on_loopback() -> None:
    config = MooncakeConfig()
    assert config.local_hostname == config.bind_address == "127.0.0.1"
    assert config.metadata_server == "P2PHANDSHAKE"
    assert config.protocol == "tcp"


def test_precedence_overrides_mapping_environment() -> None:
    env = {
        "MOONCAKE_MASTER": "10.0.0.1:50051",
        "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.2",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1GiB",
        "MC_TCP_BIND_ADDRESS": "10.0.0.2",
    }
    config = MooncakeConfig.from_mapping({"local_buffer_size": "32MB"}, env=env)
    assert config.master_server_address == "10.0.0.1:50051"
    assert config.local_hostname == config.bind_address == "10.0.0.2"
    assert config.global_segment_size == 1 << 30
    assert config.local_buffer_size == 32 << 20
    config = MooncakeConfig.from_mapping(
        {"master_server_address": "127.0.0.1:1"}, env=env, local_hostname="127.0.0.1"
    )
    assert config.master_server_address == "127.0.0.1:1"
    assert config.local_hostname == "127.0.0.1"
    assert config.bind_address == "10.0.0.2"  # from MC_TCP_BIND_ADDRESS


def test_bind_address_defaults_to_local_hostname() -> None:
    assert MooncakeConfig.from_mapping({"local_hostname": "10.1.2.3"}, env={}).bind_address == (
        "10.1.2.3"
    )


def test_every_field_has_an_environment_variable() -> None:
    assert set(ENV_VARS) == {
        "master_server_address",
        "local_hostname",
        "metadata_server",
        "protocol",
        "device_name",
        "global_segment_size",
        "local_buffer_size",
        "bind_address",
    }


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"master_server_address": "localhost"}, "master_server_address: expected 'host:port'"),
        ({"master_server_address": "h:70000"}, "port in 1..65535"),
        ({"local_hostname": "h:1"}, "local_hostname: expected a host name or IP address"),
        ({"protocol": "udp"}, "protocol: expected one of"),
        ({"protocol": "tcp", "device_name": "mlx5_0"}, "device_name: expected ''"),
        ({"global_segment_size": "lots"}, "global_segment_size: expected a byte count"),
        ({"global_segment_size": 1 << 20}, "global_segment_size: expected at least 16777216"),
        ({"local_buffer_size": 0}, "local_buffer_size: expected a positive byte count"),
        ({"bind_address": "eth0"}, "bind_address: expected an IP address"),
        ({"timeout_s": 0}, "timeout_s: expected seconds"),
        ({"segment": 1}, "mooncake config: unknown keys"),
    ],
)
def test_wrong_values_are_clear_errors(values, message) -> None:
    with pytest.raises(ValueError, match=message):
        MooncakeConfig.from_mapping(values, env={})


def test_wrong_environment_value_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="protocol: expected one of"):
        MooncakeConfig.from_mapping(env={"MOONCAKE_PROTOCOL": "carrier-pigeon"})


def test_parse_size_bytes() -> None:
    assert parse_size_bytes("x", "512KB") == 512 << 10
    assert parse_size_bytes("x", "1.5 GB") == 3 << 29
    assert parse_size_bytes("x", 7) == 7
    with pytest.raises(ValueError, match="x: expected a positive byte count"):
        parse_size_bytes("x", True)
