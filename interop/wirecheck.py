#!/usr/bin/env python3
"""Checks one interop run on the wire: reads the loopback capture with tshark (decrypting it with
the endpoints' SSLKEYLOGFILE) and verifies what the test case is about, the way the
quic-interop-runner does: the negotiated version, ALPN, cipher suite, Retry, resumption, 0-RTT,
key phase changes, ECN marks and ECN counts, the anti-amplification limit, the number of
connections, and for the cases that need them: a Version Negotiation packet answering the
client's first packet (versionnegotiation), the ClientHello sent again (longrtt), the
certificate chain in the server's Handshake CRYPTO data (amplificationlimit), IPv6 only (ipv6).

    wirecheck.py --case CASE --port SERVER_PORT --pcap FILE [--keylog FILE] [--files N] [--alpn A]

Prints a summary; the last line says what failed. Exit 0 when the run passes the checks.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field

V1, V2 = 0x00000001, 0x6B3343CF
# Long header packet types by version (RFC 9000 17.2, RFC 9369 3.2).
LONG_TYPES = {
    V1: {0: "initial", 1: "0rtt", 2: "handshake", 3: "retry"},
    V2: {1: "initial", 2: "0rtt", 3: "handshake", 0: "retry"},
}
CHACHA20 = 0x1303

FIELDS = [
    "frame.number",
    "ip.src",
    "udp.srcport",
    "ip.dst",
    "udp.dstport",
    "ipv6.src",
    "ipv6.dst",
    "udp.length",
    "ip.dsfield.ecn",
    "quic.header_form",
    "quic.version",
    "quic.long.packet_type",
    "quic.long.packet_type_v2",
    "quic.scid",
    "quic.dcid",
    "quic.key_phase",
    "quic.frame_type",
    "quic.crypto.offset",
    "quic.crypto.length",
    "tls.handshake.type",
    "tls.handshake.ciphersuite",
    "tls.handshake.extension.type",
    "tls.handshake.extensions_alpn_str",
]


@dataclass
class Packet:
    long: bool
    version: int | None = None
    kind: str = "1rtt"  # initial, 0rtt, handshake, retry, vn, 1rtt
    scid: str | None = None
    dcid: str | None = None
    key_phase: int | None = None


@dataclass
class Datagram:
    number: int
    from_server: bool
    size: int  # UDP payload bytes
    ecn: int
    src: str = ""
    dst: str = ""
    ipv6: bool = False
    packets: list[Packet] = field(default_factory=list)
    frame_types: list[int] = field(default_factory=list)
    crypto_offsets: list[int] = field(default_factory=list)
    crypto_lengths: list[int] = field(default_factory=list)
    hs_types: list[int] = field(default_factory=list)
    ciphers: list[int] = field(default_factory=list)
    extensions: list[int] = field(default_factory=list)
    alpns: list[str] = field(default_factory=list)


def ints(s: str, base: int = 10) -> list[int]:
    out = []
    for x in s.split(",") if s else []:
        x = x.strip()
        if not x:
            continue
        try:
            out.append(int(x, 16) if x.startswith("0x") else int(x, base))
        except ValueError:
            pass
    return out


def read(pcap: str, keylog: str | None, port: int) -> list[Datagram]:
    cmd = ["tshark", "-n", "-r", pcap, "-d", f"udp.port=={port},quic", "-T", "fields",
           "-E", "occurrence=a", "-E", "aggregator=,", "-E", "separator=\t"]
    if keylog:
        cmd += ["-o", f"tls.keylog_file:{keylog}"]
    for f in FIELDS:
        cmd += ["-e", f]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    grams = []
    for line in out.splitlines():
        cols = line.split("\t")
        if len(cols) < len(FIELDS):
            cols += [""] * (len(FIELDS) - len(cols))
        row = dict(zip(FIELDS, cols))
        if not row["udp.srcport"]:
            continue
        d = Datagram(
            number=int(row["frame.number"]),
            from_server=int(row["udp.srcport"]) == port,
            size=int(row["udp.length"]) - 8,
            ecn=(ints(row["ip.dsfield.ecn"]) or [0])[0],
            src=f'{row["ip.src"] or row["ipv6.src"]}:{row["udp.srcport"]}',
            dst=f'{row["ip.dst"] or row["ipv6.dst"]}:{row["udp.dstport"]}',
            ipv6=not row["ip.src"] and bool(row["ipv6.src"]),
        )
        forms = ints(row["quic.header_form"])
        versions = ints(row["quic.version"], 16)
        types_v1 = ints(row["quic.long.packet_type"])
        types_v2 = ints(row["quic.long.packet_type_v2"])
        scids = [s for s in row["quic.scid"].split(",") if s]
        dcids = [s for s in row["quic.dcid"].split(",") if s]
        phases = ints(row["quic.key_phase"])
        li = si = i1 = i2 = 0
        for form in forms:
            if form == 1:
                p = Packet(long=True)
                p.version = versions[li] if li < len(versions) else None
                if p.version == 0:
                    p.kind = "vn"
                elif p.version == V2:
                    t = types_v2[i2] if i2 < len(types_v2) else None
                    i2 += 1
                    p.kind = LONG_TYPES[V2].get(t, "?")
                else:
                    t = types_v1[i1] if i1 < len(types_v1) else None
                    i1 += 1
                    p.kind = LONG_TYPES[V1].get(t, "?")
                p.scid = scids[li] if li < len(scids) else None
                p.dcid = dcids[li] if li < len(dcids) else None
                li += 1
            else:
                p = Packet(long=False)
                p.key_phase = phases[si] if si < len(phases) else None
                si += 1
            d.packets.append(p)
        d.frame_types = ints(row["quic.frame_type"])
        d.crypto_offsets = ints(row["quic.crypto.offset"])
        d.crypto_lengths = ints(row["quic.crypto.length"])
        d.hs_types = ints(row["tls.handshake.type"])
        d.ciphers = ints(row["tls.handshake.ciphersuite"], 16)
        d.extensions = ints(row["tls.handshake.extension.type"])
        d.alpns = [x for x in row["tls.handshake.extensions_alpn_str"].split(",") if x]
        grams.append(d)
    return grams


def case_needs_raw_dcid(case: str) -> bool:
    return case == "versionnegotiation"


def raw_first_dcid(pcap: str, port: int) -> str | None:
    """The DCID of the first long header packet the client sent, read from its bytes."""
    out = subprocess.run(
        ["tshark", "-n", "-r", pcap, "-Y", f"udp.dstport=={port}", "-c", "1",
         "-T", "fields", "-e", "udp.payload"],
        capture_output=True, text=True, check=False).stdout.strip().replace(":", "")
    try:
        d = bytes.fromhex(out.split(",")[0])
    except ValueError:
        return None
    if len(d) < 6 or not d[0] & 0x80 or len(d) < 6 + d[5]:
        return None
    return d[6:6 + d[5]].hex()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pcap", required=True)
    ap.add_argument("--keylog")
    ap.add_argument("--files", type=int, default=0)
    ap.add_argument("--alpn", help="the ALPN the server must select (EncryptedExtensions)")
    a = ap.parse_args()

    grams = read(a.pcap, a.keylog, a.port)
    cli = [d for d in grams if not d.from_server]
    srv = [d for d in grams if d.from_server]

    def pkts(ds, kind=None):
        return [p for d in ds for p in d.packets if kind is None or p.kind == kind]

    # Connections: distinct server connection IDs in the server's Initial packets.
    conns = []
    for p in pkts(srv, "initial"):
        if p.scid and p.scid not in conns:
            conns.append(p.scid)
    srv_hs_versions = sorted({p.version for p in pkts(srv, "handshake")})
    cli_first_version = next((p.version for p in pkts(cli) if p.long), None)
    suites = sorted({c for d in srv for c in d.ciphers})
    retries = len(pkts(srv, "retry"))
    vns = len(pkts(srv, "vn"))
    zero_rtt = pkts(cli, "0rtt")
    server_hellos = sum(d.hs_types.count(2) for d in srv)
    psk_hellos = sum(1 for d in srv if 2 in d.hs_types and 41 in d.extensions)
    certificates = sum(d.hs_types.count(11) for d in srv)
    # Short header packets tshark could decrypt: those in datagrams with decoded frames.
    short_cli = [p for d in cli if d.frame_types for p in d.packets if not p.long]
    short_srv = [p for d in srv if d.frame_types for p in d.packets if not p.long]
    undecrypted = sum(1 for d in grams if any(not p.long for p in d.packets) and not d.frame_types)
    phases_cli = sorted({p.key_phase for p in short_cli if p.key_phase is not None})
    phases_srv = sorted({p.key_phase for p in short_srv if p.key_phase is not None})
    # Who changed keys first: the first decrypted datagram carrying key phase 1.
    first_phase1 = next(
        (("server" if d.from_server else "client")
         for d in grams if d.frame_types
         for p in d.packets if not p.long and p.key_phase == 1),
        None,
    )
    ecn_cli = sum(1 for d in cli if d.ecn in (1, 2, 3))
    ecn_srv = sum(1 for d in srv if d.ecn in (1, 2, 3))
    ack_ecn_cli = sum(d.frame_types.count(3) for d in cli)
    ack_ecn_srv = sum(d.frame_types.count(3) for d in srv)
    client_addrs = []
    for d in cli:
        if d.src not in client_addrs:
            client_addrs.append(d.src)
    challenges_srv = sum(d.frame_types.count(0x1A) for d in srv)
    # A client with zero-length connection IDs (Chromium) gets short headers that tshark can
    # match to the connection only by address: after a rebinding it cannot decrypt what the
    # server sends. The client's PATH_RESPONSE (decryptable: it carries the server's CID)
    # answers a PATH_CHALLENGE the server sent on the new path.
    responses_cli = sum(d.frame_types.count(0x1B) for d in cli)
    # connectionmigration: the client starts at the server's address and moves to its
    # preferred one (RFC 9000 9.6) after validating it with PATH_CHALLENGE.
    first_server_addr = cli[0].dst if cli else ""
    to_other = [d for d in cli if d.dst != first_server_addr]
    from_other = [d for d in srv if d.src != first_server_addr]
    challenges_cli = sum(d.frame_types.count(0x1A) for d in cli)
    last_1rtt_cli = next((d for d in reversed(cli) if any(not p.long for p in d.packets)), None)
    # The protocols the server selected (its EncryptedExtensions, once decrypted).
    server_alpns = sorted({x for d in srv for x in d.alpns})
    # versionnegotiation: a Version Negotiation packet whose source connection ID is the
    # destination connection ID of the client's first packet (RFC 9000 17.2.1), as the runner
    # checks it.
    first_cli_dcid = next((p.dcid for d in cli for p in d.packets if p.long), None)
    if case_needs_raw_dcid(a.case) and cli and not first_cli_dcid:
        # tshark does not dissect a packet of a version it does not know past its header
        # form: read the DCID from the datagram itself (RFC 9000 17.2).
        first_cli_dcid = raw_first_dcid(a.pcap, a.port)
    vn_scids = [p.scid for d in srv for p in d.packets if p.kind == "vn"]
    # longrtt: datagrams of the client's that carry its ClientHello, the first time (a TLS
    # handshake message of type 1) or again (tshark does not name a retransmitted one: an
    # Initial-only datagram with CRYPTO data at offset 0 can only be a ClientHello).
    client_hellos = sum(
        1 for d in cli
        if d.packets and all(p.kind == "initial" for p in d.packets)
        and (1 in d.hs_types or 0 in d.crypto_offsets))
    # amplificationlimit: how far the server's Handshake CRYPTO stream went (the runner wants
    # at least 7,500 bytes: the long certificate chain was sent).
    hs_crypto_end = max(
        (o + n for d in srv if any(p.kind == "handshake" for p in d.packets)
         for o, n in zip(d.crypto_offsets, d.crypto_lengths)), default=0)
    ipv4_datagrams = sum(1 for d in grams if not d.ipv6)

    def hexv(v):
        return "none" if v is None else f"0x{v:08x}"

    print(f"datagrams: {len(cli)} from the client, {len(srv)} from the server; "
          f"{undecrypted} with undecrypted short headers")
    print(f"connections (server Initial SCIDs): {len(conns)}; server hellos: {server_hellos} "
          f"({psk_hellos} with a PSK), server Certificate messages: {certificates}")
    print(f"client's first version {hexv(cli_first_version)}; server Handshake versions "
          f"{[hexv(v) for v in srv_hs_versions]}; version negotiation packets: {vns}")
    print(f"cipher suites: {[hex(c) for c in suites]}; Retry packets: {retries}; "
          f"client 0-RTT packets: {len(zero_rtt)}")
    print(f"key phases seen: client {phases_cli}, server {phases_srv}; "
          f"first to use key phase 1: {first_phase1}")
    print(f"ECN-marked datagrams: client {ecn_cli}/{len(cli)}, server {ecn_srv}/{len(srv)}; "
          f"ACK_ECN frames: client {ack_ecn_cli}, server {ack_ecn_srv}")

    # Anti-amplification: before the client proves its address (its first Handshake packet),
    # the server may send at most 3x what it received.
    received = sent = 0
    amp_violation = None
    peak_ratio = 0.0
    for d in grams:
        if not d.from_server:
            if any(p.kind == "handshake" for p in d.packets):
                break
            received += d.size
        else:
            if any(p.kind in ("retry", "vn") for p in d.packets):
                continue
            sent += d.size
            if received:
                peak_ratio = max(peak_ratio, sent / received)
            if sent > 3 * received and amp_violation is None:
                amp_violation = (d.number, sent, received)
    print(f"ALPN selected by the server: {server_alpns or 'not seen (undecrypted?)'}")
    print(f"client addresses seen by the server: {len(client_addrs)}; server PATH_CHALLENGE "
          f"frames: {challenges_srv}; client PATH_RESPONSE frames: {responses_cli}")
    print(f"before address validation: server sent {sent} bytes for {received} received "
          f"(peak ratio {peak_ratio:.2f}); server Handshake CRYPTO data up to offset "
          f"{hs_crypto_end}")
    print(f"client's first DCID {first_cli_dcid}; Version Negotiation SCIDs {vn_scids}; "
          f"client datagrams with a ClientHello: {client_hellos}; IPv4 datagrams: "
          f"{ipv4_datagrams}, IPv6: {len(grams) - ipv4_datagrams}")

    failures = []
    case = a.case
    # versionnegotiation: the client may give up (no connection) or go on in a version the
    # server offered (one connection).
    expected_conns = {"resumption": 2, "zerortt": 2, "handshakeloss": a.files or None,
                      "handshakecorruption": a.files or None,
                      "versionnegotiation": None}.get(case, 1)
    if expected_conns is not None and len(conns) != expected_conns:
        failures.append(f"expected {expected_conns} connection(s), saw {len(conns)}")
    if undecrypted and case in ("keyupdate", "chacha20"):
        failures.append(f"{undecrypted} datagrams could not be decrypted (key log incomplete?)")
    if amp_violation:
        n, s, r = amp_violation
        failures.append(f"server exceeded the anti-amplification limit at frame {n}: sent {s} "
                        f"bytes having received {r}")
    if case == "chacha20" and suites != [CHACHA20]:
        failures.append(f"cipher suite {[hex(c) for c in suites]}, expected 0x1303")
    if case == "v2" and srv_hs_versions != [V2]:
        failures.append(f"server Handshake packets in {[hexv(v) for v in srv_hs_versions]}, "
                        "expected QUIC v2 only")
    if case != "v2" and srv_hs_versions and srv_hs_versions != [V1]:
        failures.append(f"version {[hexv(v) for v in srv_hs_versions]} in a v1 test")
    if case == "retry" and retries == 0:
        failures.append("no Retry packet")
    if case != "retry" and retries:
        failures.append(f"{retries} unexpected Retry packet(s)")
    if case in ("resumption", "zerortt"):
        if psk_hellos < 1:
            failures.append("the second connection did not resume (no pre_shared_key in a ServerHello)")
        if certificates > 1:
            failures.append(f"{certificates} Certificate messages: the second handshake was a full one")
    if case == "zerortt" and not zero_rtt:
        failures.append("no 0-RTT packets from the client")
    # A corrupted client packet can read as any type: 0-RTT is not held against those cases.
    if case != "zerortt" and zero_rtt and not case.endswith("corruption"):
        failures.append(f"{len(zero_rtt)} unexpected 0-RTT packets")
    if case == "keyupdate":
        if 1 not in phases_cli:
            failures.append("the client never sent with key phase 1")
        if 1 not in phases_srv:
            failures.append("the server never answered with key phase 1")
        # Who updates first does not matter to the runner (the server gets "transfer" and may
        # update on its own schedule); first_phase1 is printed above.
    if case == "ecn":
        if not ecn_cli:
            failures.append("the client sent no ECN-marked packets")
        if not ecn_srv:
            failures.append("the server sent no ECN-marked packets")
        if not ack_ecn_cli:
            failures.append("the client sent no ACK frames with ECN counts")
        if not ack_ecn_srv:
            failures.append("the server sent no ACK frames with ECN counts")
    if case in ("rebind-port", "rebind-addr"):
        if len(client_addrs) < 2:
            failures.append("the client's address never changed (no rebinding happened)")
        elif challenges_srv < 1 and responses_cli < 1:
            failures.append("the server never validated the new path (no PATH_CHALLENGE)")
        if case == "rebind-addr" and len({a.rsplit(":", 1)[0] for a in client_addrs}) < 2:
            failures.append("the client's IP address never changed")
    if case == "connectionmigration":
        print(f"server address {first_server_addr}; client datagrams to other addresses: "
              f"{len(to_other)} ({sorted({d.dst for d in to_other})}); server datagrams from "
              f"them: {len(from_other)}; client PATH_CHALLENGE frames: {challenges_cli}")
        if not to_other:
            failures.append("the client never sent to another server address")
        elif len(from_other) < 10:
            failures.append(f"only {len(from_other)} datagrams came from the preferred address: "
                            "the transfer did not move there")
        if last_1rtt_cli is not None and last_1rtt_cli.dst == first_server_addr:
            failures.append("the client's last datagrams went to the original address again")
    if a.alpn and server_alpns and server_alpns != [a.alpn]:
        failures.append(f"the server selected ALPN {server_alpns}, expected {a.alpn}")
    if case == "http3" and server_alpns != ["h3"]:
        failures.append(f"ALPN h3 not seen in the server's EncryptedExtensions ({server_alpns})")
    if case == "amplificationlimit" and peak_ratio < 2.0:
        failures.append(f"the server's first flight was small (ratio {peak_ratio:.2f}): "
                        "the limit was not exercised")
    if case == "amplificationlimit" and hs_crypto_end < 7500:
        failures.append(f"the server sent only {hs_crypto_end} bytes of Handshake CRYPTO data "
                        "(under 7,500): not the long certificate chain?")
    if case == "versionnegotiation":
        if first_cli_dcid is None:
            failures.append("no long header packet from the client")
        elif first_cli_dcid not in vn_scids:
            failures.append(f"no Version Negotiation packet with SCID {first_cli_dcid} (the "
                            f"client's first DCID); saw {vn_scids}")
    if case == "longrtt" and client_hellos < 2:
        failures.append(f"the client sent its ClientHello {client_hellos} time(s); the runner "
                        "expects at least 2 on a 1.5 s round trip")
    if case == "ipv6" and ipv4_datagrams:
        failures.append(f"{ipv4_datagrams} IPv4 datagrams in an IPv6 test")

    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
