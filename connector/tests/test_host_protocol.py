"""Host client unit tests against a scripted peer: what the client does when a target misbehaves.

The peer is a few lines of socket code driven by the codec; it plays exactly one bad behaviour per
test (a wrong ICResp, a TermReq, an unknown command id, silence) so the client's reaction is pinned
down independently of any real target.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest

from adp_connector.nvmeof.host import Controller, HostConfig, NvmeProtocolError, NvmeTransportError
from adp_connector.nvmeof.host.queue import QueuePair, QueueParams
from adp_wire import (
    CapsuleResp,
    FatalErrorStatus,
    ICResp,
    PduDecoder,
    TermReq,
    encode_bytes,
)
from adp_wire.sqe import Cqe, Sqe, keep_alive_cmd


def scripted_peer(script: Callable[[socket.socket, PduDecoder], None]) -> tuple[int, threading.Thread]:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def run() -> None:
        conn, _ = srv.accept()
        srv.close()
        with conn:
            try:
                script(conn, PduDecoder(receiver_is_host=False))
            except OSError:
                pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return port, t


def next_pdu(conn: socket.socket, dec: PduDecoder):
    while (pdu := dec.next_pdu()) is None:
        data = conn.recv(65536)
        if not data:
            return None
        dec.feed(data)
    return pdu


def open_queue(port: int) -> QueuePair:
    sock = socket.create_connection(("127.0.0.1", port))
    q = QueuePair(sock, 0, 4, QueueParams(connect_timeout=2))
    return q


def test_icresp_with_wrong_digest_grant_is_refused():
    def script(conn, dec):
        next_pdu(conn, dec)
        conn.sendall(encode_bytes(ICResp(maxh2cdata=65536, hdgst=True)))
        conn.recv(1)

    port, _ = scripted_peer(script)
    q = open_queue(port)
    with pytest.raises(NvmeProtocolError, match="granted digests"):
        q.initialize()
    q.close()


def test_icresp_with_tiny_maxh2cdata_is_refused():
    def script(conn, dec):
        next_pdu(conn, dec)
        conn.sendall(encode_bytes(ICResp(maxh2cdata=1024)))
        conn.recv(1)

    port, _ = scripted_peer(script)
    q = open_queue(port)
    with pytest.raises(NvmeProtocolError, match="unacceptable ICResp"):
        q.initialize()
    q.close()


def test_silent_target_times_out_at_icresp():
    port, _ = scripted_peer(lambda conn, dec: conn.recv(1000) and conn.recv(1))
    q = open_queue(port)
    with pytest.raises(NvmeTransportError, match="ICReq/ICResp"):
        q.initialize()
    q.close()


def _handshake(conn, dec):
    next_pdu(conn, dec)
    conn.sendall(encode_bytes(ICResp(maxh2cdata=65536)))


def test_term_req_fails_in_flight_commands():
    def script(conn, dec):
        _handshake(conn, dec)
        next_pdu(conn, dec)
        conn.sendall(encode_bytes(TermReq(FatalErrorStatus.INVALID_HEADER_FIELD, 2, b"\x04" * 8)))
        conn.recv(1)

    port, _ = scripted_peer(script)
    q = open_queue(port)
    q.initialize()
    fut = q.submit(keep_alive_cmd(), what="Keep Alive", timeout=5)
    with pytest.raises(NvmeTransportError, match="C2HTermReq FES 0x1"):
        fut.result(5)
    assert not q.alive
    with pytest.raises(NvmeTransportError):
        q.submit(keep_alive_cmd())
    q.close()


def test_completion_for_unknown_cid_is_a_protocol_error():
    def script(conn, dec):
        _handshake(conn, dec)
        cmd = next_pdu(conn, dec)
        cid = Sqe.decode(cmd.sqe).cid
        conn.sendall(encode_bytes(CapsuleResp(Cqe(cid=cid + 7).encode())))
        conn.recv(1)

    port, _ = scripted_peer(script)
    q = open_queue(port)
    q.initialize()
    fut = q.submit(keep_alive_cmd(), timeout=5)
    with pytest.raises(NvmeTransportError, match="unknown command id"):
        fut.result(5)
    q.close()


def test_unanswered_command_expires():
    def script(conn, dec):
        _handshake(conn, dec)
        next_pdu(conn, dec)
        conn.recv(1)  # never answer

    port, _ = scripted_peer(script)
    q = open_queue(port)
    q.initialize()
    fut = q.submit(keep_alive_cmd(), what="Keep Alive", timeout=0.2)
    time.sleep(0.3)
    assert q.expire(time.monotonic())
    with pytest.raises(Exception, match="timed out"):
        fut.result(2)
    q.close()


def test_connect_refused_port_is_a_transport_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(NvmeTransportError, match="cannot reach"):
        Controller.connect(HostConfig(trsvcid=port, subnqn="nqn.x", connect_timeout=1))


def test_host_config_validation():
    with pytest.raises(ValueError, match="queue_depth"):
        HostConfig(queue_depth=0)
    with pytest.raises(ValueError, match="io_queues"):
        HostConfig(io_queues=500)
    assert HostConfig().hostnqn.startswith("nqn.2014-08.org.nvmexpress:uuid:")
