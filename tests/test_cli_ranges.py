"""Every number `pdflash generate` (and `Client.request`) accepts is range-checked before it reaches a
protobuf field: one line naming the option and its range, exit code 2, never a traceback; the words are
the server's (pdflash/validation.py)."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pdflash import cli
from pdflash.client import Client
from pdflash.errors import InvalidArgument
from pdflash.v1 import common_pb2, drafter_pb2

# A port nothing listens on: a request that passes the checks fails to connect (UNAVAILABLE), which is
# how the tests below tell "refused by the range check" from "sent".
NOWHERE = "127.0.0.1:1"

# option -> (values it must refuse, values it must let through), as typed on the command line
CASES = {
    "--max-tokens": (["-1", "4294967296", "1e99", "nan", "inf", "-inf", "2.5", "x"], ["0", "1", "4294967295"]),
    "--temperature": (["-0.5", "100.5", "1e99", "nan", "inf", "-inf", "x"], ["0", "0.7", "100"]),
    "--top-p": (["-0.1", "1.5", "1e99", "nan", "inf", "-inf"], ["0", "0.9", "1"]),
    "--top-k": (["-1", "2147483648", "1e99", "nan", "inf", "-inf"], ["0", "40", "2147483647"]),
    "--seed": (["-1", "18446744073709551616", "1e99", "nan", "inf", "-inf"], ["0", "18446744073709551615"]),
    "--block-size": (["-1", "4294967296", "1e99", "nan", "inf", "-inf"], ["0", "1", "16"]),
    "--timeout": (["-1", "0", "1e99", "nan", "inf", "-inf", "x"], ["0.5"]),
}
RANGES = {  # what the one line must say about the option's range
    "--max-tokens": "[0, 4294967295]", "--temperature": "0 (greedy) or in (0, 100]", "--top-p": "0 (off) or in (0, 1]", "--top-k": "[0, 2147483647]",
    "--seed": "[0, 18446744073709551615]", "--block-size": "[0, 4294967295]", "--timeout": "(0, 1000000000]",
}


def generate(capsys, *argv: str) -> tuple[int, list[str]]:
    rc = cli.main(["generate", "def f():", "--target", NOWHERE, *argv])
    err = capsys.readouterr().err
    return rc, err.splitlines()


@pytest.mark.parametrize("option, value", [(o, v) for o, (bad, _) in CASES.items() for v in bad])
def test_generate_refuses_out_of_range_numbers_with_one_line(capsys, option, value):
    rc, lines = generate(capsys, f"{option}={value}", *(["--timeout", "5"] if option != "--timeout" else []))
    assert rc == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"pdflash generate: {option}: must be "), lines[0]
    assert RANGES[option] in lines[0] and "got" in lines[0]


@pytest.mark.parametrize("option, value", [(o, v) for o, (_, good) in CASES.items() for v in good])
def test_generate_sends_numbers_in_range(capsys, option, value):
    args = [f"{option}={value}"] + (["--timeout", "5"] if option != "--timeout" else [])
    rc, lines = generate(capsys, *args)
    assert rc == 1 and lines and lines[-1].startswith("error: UNAVAILABLE"), lines  # passed the checks, then no server


def test_the_reported_traceback_is_gone():
    """The command of the issue, as a process: one line, exit 2, no traceback."""
    r = subprocess.run([sys.executable, "-m", "pdflash.cli", "generate", "def f():", "--max-tokens", "-1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == "pdflash generate: --max-tokens: must be in [0, 4294967295] (0 = the server's default), got -1"
    assert r.stdout == ""


def test_several_bad_options_are_one_line_each(capsys):
    rc, lines = generate(capsys, "--max-tokens=-1", "--top-k=-1", "--timeout=nan")
    assert rc == 2 and sorted(line.split(":")[1].strip() for line in lines) == ["--max-tokens", "--timeout", "--top-k"]


@pytest.mark.parametrize("kw, field", [
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 2**32}, "max_tokens"), ({"max_tokens": 1.5}, "max_tokens"),
    ({"temperature": math.nan}, "sampling.temperature"), ({"temperature": math.inf}, "sampling.temperature"),
    ({"temperature": 1e300}, "sampling.temperature"), ({"temperature": "hot"}, "sampling.temperature"),
    ({"top_p": -math.inf}, "sampling.top_p"), ({"top_k": 2**31}, "sampling.top_k"), ({"seed": -1}, "sampling.seed"),
    ({"seed": 2**64}, "sampling.seed"), ({"block_size": -1}, "block_size"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"drafter": "eagle"}, "drafter"),
])
def test_client_request_refuses_what_no_field_can_hold(kw, field):
    with pytest.raises(InvalidArgument) as e:
        Client.request("x", **kw)
    assert [v.field for v in e.value.violations] == [field]


def test_client_checks_token_ids_and_timeouts():
    with pytest.raises(InvalidArgument) as e:
        Client.request([1, 2**31], max_tokens=4)
    assert [v.field for v in e.value.violations] == ["prompt_tokens.ids"]
    assert list(Client.request([1, 2], max_tokens=4).prompt_tokens.ids) == [1, 2]
    with Client(NOWHERE) as c, pytest.raises(InvalidArgument, match="timeout"):
        c.stream(Client.request("x"), timeout=math.nan)


def server_violations(stack, req: drafter_pb2.GenerateRequest) -> dict[str, str]:
    with Client(stack.drafter) as c, pytest.raises(grpc.RpcError) as e:
        list(c.stream(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    out = {}
    for d in rpc_status.from_call(e.value).details:
        br = error_details_pb2.BadRequest()
        if d.Unpack(br):
            out.update({v.field: v.description for v in br.field_violations})
    return out


@pytest.mark.slow
def test_client_and_server_refuse_with_the_same_words(stack):
    """Values a field can hold but no server accepts: the server's INVALID_ARGUMENT and the client's check agree
    word for word."""
    for sampling in ({"temperature": -2.0}, {"temperature": 150.0}, {"top_p": 1.5}, {"top_k": -3},
                     {"temperature": math.nan}, {"top_p": math.inf}):
        raw = drafter_pb2.GenerateRequest(prompt="x = 1", max_tokens=4, sampling=common_pb2.SamplingParams(**sampling))
        server = server_violations(stack, raw)
        with pytest.raises(InvalidArgument) as e:
            Client.request("x = 1", max_tokens=4, **sampling)
        client = {v.field: v.description for v in e.value.violations}
        assert client == server, (sampling, client, server)


def test_pdflash_version(capsys):
    from pdflash.cli import _version, main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out == f"pdflash {_version()}\n" and _version()[0].isdigit(), out


def test_the_version_of_a_checkout_that_is_not_installed(monkeypatch):
    """Run from a checkout on PYTHONPATH (the GPU machine's copy), `pdflash --version` says the checkout's
    pyproject.toml version, and that it is not installed."""
    import tomllib
    from importlib import metadata

    from pdflash.cli import _version

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    want = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert _version() == f"{want} (a checkout, not installed)"
