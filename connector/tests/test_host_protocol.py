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


class _CountingSocket(socket.socket):
    """A real socket that counts the receive calls of the payload's size class (what the reader does per PDU)."""

    payload_calls = 0

    def recv_into(self, buffer, nbytes=0, flags=0):
        if len(buffer) > 4096:
            type(self).payload_calls += 1
        return super().recv_into(buffer, nbytes, flags)


@pytest.mark.parametrize("waitall", [True, False], ids=["waitall", "control-no-waitall"])
def test_c2h_payload_arriving_in_pieces_is_received_in_one_call(waitall, monkeypatch):
    """A payload that trickles in (a receiver faster than its target) costs one receive call, not one per piece.

    The control turns MSG_WAITALL off and must see a call per piece, so the count is really measured.
    """
    from adp_connector.nvmeof.host import queue as queue_mod
    from adp_wire import C2HData

    if not waitall:
        monkeypatch.setattr(queue_mod, "_WAITALL", 0)
    size, pieces = 256 * 1024, 32
    payload = bytes(range(256)) * (size // 256)

    def script(conn, dec):
        _handshake(conn, dec)
        cmd = next_pdu(conn, dec)
        cid = Sqe.decode(cmd.sqe).cid
        pdu = encode_bytes(C2HData(cid, 0, data=payload, last=True, success=True))
        head = len(pdu) - size
        conn.sendall(pdu[:head])
        step = size // pieces
        for i in range(pieces):
            time.sleep(0.003)
            conn.sendall(pdu[head + i * step:head + (i + 1) * step])
        conn.recv(1)

    port, _ = scripted_peer(script)
    sock = socket.create_connection(("127.0.0.1", port))
    _CountingSocket.payload_calls = 0
    q = QueuePair(_CountingSocket(fileno=sock.detach()), 0, 4, QueueParams(connect_timeout=2))
    q.initialize()
    buf = bytearray(size)
    q.submit(keep_alive_cmd(), read_into=memoryview(buf), timeout=5).result(5)
    q.close()
    assert bytes(buf) == payload
    if waitall:
        assert _CountingSocket.payload_calls <= 2
    else:
        assert _CountingSocket.payload_calls >= 4
