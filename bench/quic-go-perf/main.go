// Command quic-go-perf speaks the "perf" protocol of draft-banks-quic-performance on quic-go,
// with the same command line and the same JSON output as `kuai bench`, so bench/run.sh drives
// every implementation alike (and either side can face kuai's).
//
// On each bidirectional stream the client sends the number of bytes it wants back (8 bytes,
// big endian) and FIN; the server answers with that many bytes and FIN.
//
//	quic-go-perf server [--listen ADDR] [--transport quic] [--no-offload]
//	quic-go-perf client [--server ADDR] [--workload bulk|requests|handshakes|idle] [--bytes N]
//	                    [--streams N] [--connections N] [--response N] [--seconds N] [--no-offload]
package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quic-go/quic-go"
)

const alpn = "perf"

// Windows like kuai bench's: large enough that flow control never limits a loopback transfer.
func quicConfig() *quic.Config {
	return &quic.Config{
		InitialStreamReceiveWindow:     8 << 20,
		MaxStreamReceiveWindow:         64 << 20,
		InitialConnectionReceiveWindow: 16 << 20,
		MaxConnectionReceiveWindow:     256 << 20,
		MaxIncomingStreams:             1000,
		MaxIdleTimeout:                 60 * time.Second,
		HandshakeIdleTimeout:           10 * time.Second,
	}
}

// cpuSeconds is the CPU time (user + system) this process used so far.
func cpuSeconds() float64 {
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return 0
	}
	s := string(b)
	i := strings.LastIndex(s, ") ")
	if i < 0 {
		return 0
	}
	f := strings.Fields(s[i+2:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (u + st) / 100 // USER_HZ
}

// rssBytes is the resident memory of this process.
func rssBytes() uint64 {
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return 0
	}
	p, _ := strconv.ParseUint(f[1], 10, 64)
	return p * 4096
}

func selfSigned() (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "localhost"},
		DNSNames:     []string{"localhost"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

func listenUDP(addr string) (*net.UDPConn, error) {
	a, err := net.ResolveUDPAddr("udp", addr)
	if err != nil {
		return nil, err
	}
	return net.ListenUDP("udp", a)
}

func server(listen string) error {
	cert, err := selfSigned()
	if err != nil {
		return err
	}
	tlsConf := &tls.Config{
		Certificates: []tls.Certificate{cert},
		NextProtos:   []string{alpn},
		MinVersion:   tls.VersionTLS13,
	}
	udp, err := listenUDP(listen)
	if err != nil {
		return fmt.Errorf("bind %s: %w", listen, err)
	}
	tr := &quic.Transport{Conn: udp}
	ln, err := tr.Listen(tlsConf, quicConfig())
	if err != nil {
		return err
	}
	fmt.Printf("quic-go-perf server on udp %s\n", udp.LocalAddr())
	var served atomic.Uint64
	go func() {
		for {
			time.Sleep(time.Second)
			fmt.Fprintf(os.Stderr, "{\"server_cpu_s\":%.3f,\"server_rss\":%d,\"served_bytes\":%d}\n",
				cpuSeconds(), rssBytes(), served.Load())
		}
	}()
	block := make([]byte, 256*1024)
	for i := range block {
		block[i] = 0x5a
	}
	for {
		conn, err := ln.Accept(context.Background())
		if err != nil {
			return err
		}
		go func(conn *quic.Conn) {
			for {
				str, err := conn.AcceptStream(context.Background())
				if err != nil {
					return
				}
				go func(str *quic.Stream) {
					var hdr [8]byte
					if _, err := io.ReadFull(str, hdr[:]); err != nil {
						str.CancelWrite(0)
						return
					}
					// Drain the upload.
					if _, err := io.Copy(io.Discard, str); err != nil {
						str.CancelWrite(0)
						return
					}
					left := binary.BigEndian.Uint64(hdr[:])
					for left > 0 {
						n := uint64(len(block))
						if left < n {
							n = left
						}
						if _, err := str.Write(block[:n]); err != nil {
							return
						}
						left -= n
						served.Add(n)
					}
					str.Close()
				}(str)
			}
		}(conn)
	}
}

type workload struct {
	server      string
	workload    string
	bytes       uint64
	streams     uint64
	connections uint64
	response    uint64
	seconds     uint64
}

func request(conn *quic.Conn, size uint64, buf []byte) (uint64, error) {
	str, err := conn.OpenStreamSync(context.Background())
	if err != nil {
		return 0, err
	}
	var hdr [8]byte
	binary.BigEndian.PutUint64(hdr[:], size)
	if _, err := str.Write(hdr[:]); err != nil {
		return 0, err
	}
	str.Close()
	var got uint64
	for {
		n, err := str.Read(buf)
		got += uint64(n)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return got, err
		}
	}
	if got != size {
		return got, fmt.Errorf("short response: %d of %d", got, size)
	}
	return got, nil
}

func client(w workload) error {
	cpu0 := cpuSeconds()
	raddr, err := net.ResolveUDPAddr("udp", w.server)
	if err != nil {
		return err
	}
	network := "udp4"
	if raddr.IP.To4() == nil {
		network = "udp6"
	}
	udp, err := net.ListenUDP(network, nil)
	if err != nil {
		return err
	}
	// One UDP socket for every connection of the run.
	tr := &quic.Transport{Conn: udp}
	defer tr.Close()
	// No ClientSessionCache: full handshakes every time, no resumption.
	tlsConf := &tls.Config{
		ServerName:         "localhost",
		InsecureSkipVerify: true,
		NextProtos:         []string{alpn},
		MinVersion:         tls.VersionTLS13,
	}
	conf := quicConfig()
	dial := func() (*quic.Conn, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return tr.Dial(ctx, raddr, tlsConf, conf)
	}
	var result string
	switch w.workload {
	case "bulk":
		conn, err := dial()
		if err != nil {
			return err
		}
		start := time.Now()
		streams := w.streams
		if streams == 0 {
			streams = 1
		}
		per := w.bytes / streams
		var wg sync.WaitGroup
		var total atomic.Uint64
		errs := make(chan error, streams)
		for i := uint64(0); i < streams; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				n, err := request(conn, per, make([]byte, 256*1024))
				total.Add(n)
				if err != nil {
					errs <- err
				}
			}()
		}
		wg.Wait()
		close(errs)
		if err := <-errs; err != nil {
			return err
		}
		secs := time.Since(start).Seconds()
		st := conn.ConnectionStats()
		fmt.Fprintf(os.Stderr, "quic-go-perf: cipher %s\n", tls.CipherSuiteName(conn.ConnectionState().TLS.CipherSuite))
		conn.CloseWithError(0, "")
		t := total.Load()
		result = fmt.Sprintf("\"bytes\":%d,\"seconds\":%.4f,\"mbit_s\":%.1f,\"packets_lost\":%d,\"rtt_ms\":%.3f",
			t, secs, float64(t)*8/secs/1e6, st.PacketsLost, float64(st.SmoothedRTT.Microseconds())/1e3)
	case "requests":
		n := w.connections
		if n == 0 {
			n = 1
		}
		var conns []*quic.Conn
		for i := uint64(0); i < n; i++ {
			c, err := dial()
			if err != nil {
				return err
			}
			conns = append(conns, c)
		}
		deadline := time.Now().Add(time.Duration(w.seconds) * time.Second)
		var done atomic.Uint64
		start := time.Now()
		var wg sync.WaitGroup
		// 32 requests in flight per connection, as kuai bench.
		for _, c := range conns {
			for j := 0; j < 32; j++ {
				wg.Add(1)
				go func(c *quic.Conn) {
					defer wg.Done()
					buf := make([]byte, 64*1024)
					for time.Now().Before(deadline) {
						if _, err := request(c, w.response, buf); err != nil {
							return
						}
						done.Add(1)
					}
				}(c)
			}
		}
		wg.Wait()
		secs := time.Since(start).Seconds()
		d := done.Load()
		result = fmt.Sprintf("\"requests\":%d,\"seconds\":%.3f,\"requests_s\":%.0f", d, secs, float64(d)/secs)
		for _, c := range conns {
			c.CloseWithError(0, "")
		}
	case "handshakes":
		n := w.connections
		if n == 0 {
			n = 1
		}
		deadline := time.Now().Add(time.Duration(w.seconds) * time.Second)
		var done, failed atomic.Uint64
		start := time.Now()
		var wg sync.WaitGroup
		for i := uint64(0); i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(deadline) {
					c, err := dial()
					if err != nil {
						failed.Add(1)
						continue
					}
					c.CloseWithError(0, "")
					done.Add(1)
				}
			}()
		}
		wg.Wait()
		secs := time.Since(start).Seconds()
		d := done.Load()
		result = fmt.Sprintf("\"handshakes\":%d,\"failed\":%d,\"seconds\":%.3f,\"handshakes_s\":%.0f",
			d, failed.Load(), secs, float64(d)/secs)
	case "idle":
		conns := make([]*quic.Conn, 0, w.connections)
		start := time.Now()
		// 256 handshakes at a time, as kuai bench.
		for left := w.connections; left > 0; {
			batch := left
			if batch > 256 {
				batch = 256
			}
			res := make([]*quic.Conn, batch)
			errs := make([]error, batch)
			var wg sync.WaitGroup
			for i := uint64(0); i < batch; i++ {
				wg.Add(1)
				go func(i uint64) {
					defer wg.Done()
					res[i], errs[i] = dial()
				}(i)
			}
			wg.Wait()
			for i := range res {
				if errs[i] != nil {
					return errs[i]
				}
				conns = append(conns, res[i])
			}
			left -= batch
		}
		secs := time.Since(start).Seconds()
		// Hold them while the runner samples the server's memory.
		time.Sleep(time.Duration(w.seconds) * time.Second)
		result = fmt.Sprintf("\"connections\":%d,\"setup_seconds\":%.3f", len(conns), secs)
	default:
		return fmt.Errorf("unsupported workload %s", w.workload)
	}
	fmt.Printf("{\"impl\":\"quic-go\",\"transport\":\"quic\",\"workload\":\"%s\",%s,\"client_cpu_s\":%.3f,\"client_rss\":%d}\n",
		w.workload, result, cpuSeconds()-cpu0, rssBytes())
	return nil
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: quic-go-perf server|client [flags] (-h for the flags)")
	os.Exit(2)
}

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	mode := os.Args[1]
	fs := flag.NewFlagSet(mode, flag.ExitOnError)
	var err error
	switch mode {
	case "server":
		listen := fs.String("listen", "127.0.0.1:4443", "address to serve on")
		transport := fs.String("transport", "quic", "only quic")
		noOffload := fs.Bool("no-offload", false, "disable UDP GSO")
		fs.Parse(os.Args[2:])
		if *transport != "quic" {
			err = fmt.Errorf("unsupported transport %s", *transport)
			break
		}
		if *noOffload {
			os.Setenv("QUIC_GO_DISABLE_GSO", "true")
		}
		err = server(*listen)
	case "client":
		srv := fs.String("server", "127.0.0.1:4443", "server address")
		transport := fs.String("transport", "quic", "only quic")
		wl := fs.String("workload", "bulk", "bulk | requests | handshakes | idle")
		bytes := fs.Uint64("bytes", 1<<30, "bytes to download in total (bulk)")
		streams := fs.Uint64("streams", 1, "streams the bulk download is split over")
		conns := fs.Uint64("connections", 1, "connections (requests, handshakes in flight, idle)")
		response := fs.Uint64("response", 1000, "size of each response (requests)")
		seconds := fs.Uint64("seconds", 5, "how long the rate workloads run (and idle holds)")
		noOffload := fs.Bool("no-offload", false, "disable UDP GSO")
		fs.Parse(os.Args[2:])
		if *transport != "quic" {
			err = fmt.Errorf("unsupported transport %s", *transport)
			break
		}
		if *noOffload {
			os.Setenv("QUIC_GO_DISABLE_GSO", "true")
		}
		err = client(workload{*srv, *wl, *bytes, *streams, *conns, *response, *seconds})
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "quic-go-perf: %v\n", err)
		os.Exit(1)
	}
}
