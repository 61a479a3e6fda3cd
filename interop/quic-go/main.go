// Command quic-go-endpoint wraps quic-go as an interop endpoint following MISSION.md §7:
// configured by environment variables (ROLE, TESTCASE, LISTEN, WWW, CERTS, SERVER, REQUESTS,
// DOWNLOADS, SSLKEYLOGFILE, QLOGDIR), speaking HTTP/3 (ALPN h3, the default, with quic-go's
// http3 package) or HTTP/0.9 over QUIC (ALPN hq-interop).
// Exit codes: 0 success, 1 failure, 127 test case not supported.
package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"time"
	_ "unsafe" // for go:linkname

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
	"github.com/quic-go/quic-go/qlog"
)

const (
	alpnHQ = "hq-interop"
	alpnH3 = "h3"
)

// The ALPN of this run (ALPN env): alpnH3 or alpnHQ.
var alpn string

const exitUnsupported = 127

// crypto/tls does not let a caller restrict the TLS 1.3 cipher suites. These two lists are
// exported to linkname users on purpose (see go.dev/issue/67401), so the chacha20 case
// narrows them to ChaCha20-Poly1305 alone.
//
//go:linkname tls13Suites crypto/tls.defaultCipherSuitesTLS13
var tls13Suites []uint16

//go:linkname tls13SuitesNoAES crypto/tls.defaultCipherSuitesTLS13NoAES
var tls13SuitesNoAES []uint16

// The test names quic-interop-runner passes in TESTCASE (its testname() per side): several
// cases share "transfer", "handshake" or "multiconnect"; keyupdate is "keyupdate" for the
// client and "transfer" for the server. quic-go neither offers a preferred address
// (connectionmigration, the server's name for it) nor starts a connection in a version it
// does not support (versionnegotiation, as a client).
var serverCases = map[string]bool{
	"versionnegotiation": true, "handshake": true, "transfer": true, "chacha20": true,
	"retry": true, "resumption": true, "zerortt": true, "http3": true, "multiconnect": true,
	"v2": true, "ecn": true,
}

// The client side: keyupdate relies on quic-go's built-in first key update (after ~100
// packets), which the runner triggers with a large enough download.
var clientCases = map[string]bool{
	"handshake": true, "transfer": true, "chacha20": true, "retry": true, "resumption": true,
	"zerortt": true, "http3": true, "multiconnect": true, "keyupdate": true, "v2": true,
	"ecn": true,
}

func getenv(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func main() {
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	log.SetPrefix("quic-go-endpoint: ")
	role := os.Getenv("ROLE")
	tc := os.Getenv("TESTCASE")
	alpn = getenv("ALPN", alpnH3)
	if role == "prepare" {
		os.Exit(0)
	}
	// One QUIC packet per UDP datagram on the wire (MISSION.md §7): no GSO batches, which a
	// loopback capture could not split. Read by quic-go when a socket is set up.
	if os.Getenv("QUIC_GO_DISABLE_GSO") == "" {
		os.Setenv("QUIC_GO_DISABLE_GSO", "true")
	}
	if alpn != alpnHQ && alpn != alpnH3 {
		log.Printf("ALPN %q not supported (only %s and %s)", alpn, alpnH3, alpnHQ)
		os.Exit(exitUnsupported)
	}
	if tc == "http3" && alpn != alpnH3 {
		log.Printf("test case http3 needs ALPN h3, not %q", alpn)
		os.Exit(exitUnsupported)
	}
	var err error
	switch role {
	case "server":
		if !serverCases[tc] {
			log.Printf("test case %q not supported as server", tc)
			os.Exit(exitUnsupported)
		}
		err = runServer(tc)
	case "client":
		if !clientCases[tc] {
			log.Printf("test case %q not supported as client", tc)
			os.Exit(exitUnsupported)
		}
		err = runClient(tc)
	default:
		log.Printf("ROLE must be client, server or prepare, not %q", role)
		os.Exit(1)
	}
	if err != nil {
		log.Printf("%s %s failed: %v", role, tc, err)
		os.Exit(1)
	}
}

func restrictCiphers(tc string) {
	if tc == "chacha20" {
		tls13Suites = []uint16{tls.TLS_CHACHA20_POLY1305_SHA256}
		tls13SuitesNoAES = []uint16{tls.TLS_CHACHA20_POLY1305_SHA256}
	}
}

func keyLog() (io.Writer, error) {
	p := os.Getenv("SSLKEYLOGFILE")
	if p == "" {
		return nil, nil
	}
	return os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
}

func quicConfig(tc string, isServer bool) *quic.Config {
	conf := &quic.Config{
		MaxIdleTimeout:       30 * time.Second,
		HandshakeIdleTimeout: 10 * time.Second,
		MaxIncomingStreams:   1000,
	}
	if os.Getenv("QLOGDIR") != "" {
		conf.Tracer = qlog.DefaultConnectionTracer
	}
	switch {
	case tc == "v2" && isServer:
		// quic-go has no compatible version negotiation (RFC 9368); a server that only
		// offers v2 makes a v1 client switch through a Version Negotiation packet.
		conf.Versions = []quic.Version{quic.Version2}
	case tc == "v2":
		// Without RFC 9368 in quic-go, the client starts in v2 directly (v1 as fallback).
		conf.Versions = []quic.Version{quic.Version2, quic.Version1}
	default:
		conf.Versions = []quic.Version{quic.Version1}
	}
	if isServer && tc == "zerortt" {
		conf.Allow0RTT = true
	}
	return conf
}

// ---------------------------------------------------------------------------------------------
// Server

func runServer(tc string) error {
	restrictCiphers(tc)
	listen := getenv("LISTEN", "[::]:443")
	www := getenv("WWW", "/www")
	certs := getenv("CERTS", "/certs")
	cert, err := tls.LoadX509KeyPair(filepath.Join(certs, "cert.pem"), filepath.Join(certs, "priv.key"))
	if err != nil {
		return fmt.Errorf("loading certificate: %w", err)
	}
	kl, err := keyLog()
	if err != nil {
		return err
	}
	tlsConf := &tls.Config{
		Certificates: []tls.Certificate{cert},
		NextProtos:   []string{alpn},
		MinVersion:   tls.VersionTLS13,
		KeyLogWriter: kl,
	}
	addr, err := net.ResolveUDPAddr("udp", listen)
	if err != nil {
		return err
	}
	udp, err := net.ListenUDP("udp", addr)
	if err != nil {
		return err
	}
	var resetKey quic.StatelessResetKey
	copy(resetKey[:], "kuai-interop-quic-go-reset-key!!")
	tr := &quic.Transport{Conn: udp, StatelessResetKey: &resetKey}
	if tc == "retry" {
		tr.VerifySourceAddress = func(net.Addr) bool { return true }
	}
	ln, err := tr.ListenEarly(tlsConf, quicConfig(tc, true))
	if err != nil {
		return err
	}
	log.Printf("server listening on %s, ALPN %s, test case %s, serving %s", udp.LocalAddr(), alpn, tc, www)
	if alpn == alpnH3 {
		return serveH3(ln, www)
	}
	for {
		conn, err := ln.Accept(context.Background())
		if err != nil {
			return err
		}
		go serveConn(conn, www)
	}
}

// serveH3 serves the files of www over HTTP/3 on every connection of ln.
func serveH3(ln *quic.EarlyListener, www string) error {
	files := http.FileServer(http.Dir(www))
	srv := &http3.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			log.Printf("%s %s %s from %s", r.Proto, r.Method, r.URL.Path, r.RemoteAddr)
			files.ServeHTTP(w, r)
		}),
		ConnContext: func(ctx context.Context, conn *quic.Conn) context.Context {
			logHandshake(conn)
			return ctx
		},
	}
	return srv.ServeListener(ln)
}

// logHandshake logs the connection's version, cipher suite, resumption and 0-RTT once its
// handshake completes (Accept returns early connections, before that).
func logHandshake(conn *quic.Conn) {
	go func() {
		select {
		case <-conn.HandshakeComplete():
			st := conn.ConnectionState()
			log.Printf("connection from %s: version %s, cipher %s, resumed %v, 0-RTT %v",
				conn.RemoteAddr(), st.Version, tls.CipherSuiteName(st.TLS.CipherSuite),
				st.TLS.DidResume, st.Used0RTT)
		case <-conn.Context().Done():
		}
	}()
}

func serveConn(conn *quic.Conn, www string) {
	logHandshake(conn)
	for {
		str, err := conn.AcceptStream(context.Background())
		if err != nil {
			var appErr *quic.ApplicationError
			if errors.As(err, &appErr) && appErr.ErrorCode == 0 {
				return
			}
			log.Printf("connection from %s ended: %v", conn.RemoteAddr(), err)
			return
		}
		go serveStream(str, www)
	}
}

func serveStream(str *quic.Stream, www string) {
	req, err := io.ReadAll(io.LimitReader(str, 8192))
	if err != nil {
		log.Printf("stream %d: reading request: %v", str.StreamID(), err)
		str.CancelWrite(1)
		return
	}
	line := strings.TrimRight(string(req), "\r\n")
	if !strings.HasPrefix(line, "GET ") {
		log.Printf("stream %d: bad request %q", str.StreamID(), line)
		str.CancelWrite(1)
		return
	}
	p := strings.TrimSpace(strings.TrimPrefix(line, "GET "))
	if u, err := url.Parse(p); err == nil && u.Path != "" {
		p = u.Path
	}
	clean := path.Clean("/" + p)
	f, err := os.Open(filepath.Join(www, filepath.FromSlash(clean)))
	if err != nil {
		log.Printf("stream %d: %s: %v", str.StreamID(), clean, err)
		str.CancelWrite(2)
		return
	}
	defer f.Close()
	if _, err := io.Copy(str, f); err != nil {
		log.Printf("stream %d: sending %s: %v", str.StreamID(), clean, err)
		str.CancelWrite(3)
		return
	}
	str.Close()
}

// ---------------------------------------------------------------------------------------------
// Client

type request struct {
	url  *url.URL
	name string
}

func runClient(tc string) error {
	restrictCiphers(tc)
	var reqs []request
	for _, s := range strings.Fields(os.Getenv("REQUESTS")) {
		u, err := url.Parse(s)
		if err != nil {
			return fmt.Errorf("bad URL %q: %w", s, err)
		}
		name := path.Base(u.Path)
		if name == "/" || name == "." {
			name = "index.html"
		}
		reqs = append(reqs, request{u, name})
	}
	if len(reqs) == 0 {
		return errors.New("REQUESTS is empty")
	}
	downloads := getenv("DOWNLOADS", "/downloads")
	server := os.Getenv("SERVER")
	if server == "" {
		server = reqs[0].url.Host
	}
	raddr, err := net.ResolveUDPAddr("udp", server)
	if err != nil {
		return err
	}
	kl, err := keyLog()
	if err != nil {
		return err
	}
	tlsConf := &tls.Config{
		ServerName:         reqs[0].url.Hostname(),
		InsecureSkipVerify: true,
		NextProtos:         []string{alpn},
		MinVersion:         tls.VersionTLS13,
		KeyLogWriter:       kl,
		ClientSessionCache: tls.NewLRUClientSessionCache(8),
	}
	network := "udp4"
	if raddr.IP.To4() == nil {
		network = "udp6"
	}
	udp, err := net.ListenUDP(network, nil)
	if err != nil {
		return err
	}
	tr := &quic.Transport{Conn: udp}
	defer tr.Close()
	conf := quicConfig(tc, false)

	ctx, cancel := context.WithTimeout(context.Background(), 170*time.Second)
	defer cancel()

	switch tc {
	case "multiconnect":
		// One connection per request, one after another.
		for _, r := range reqs {
			if err := session(ctx, tr, raddr, tlsConf, conf, []request{r}, downloads, false); err != nil {
				return err
			}
		}
		return nil
	case "resumption", "zerortt":
		if err := session(ctx, tr, raddr, tlsConf, conf, reqs[:1], downloads, false); err != nil {
			return err
		}
		return session(ctx, tr, raddr, tlsConf, conf, reqs[1:], downloads, tc == "zerortt")
	default:
		return session(ctx, tr, raddr, tlsConf, conf, reqs, downloads, false)
	}
}

// session runs one connection that downloads reqs in parallel, one stream per request.
func session(ctx context.Context, tr *quic.Transport, raddr net.Addr, tlsConf *tls.Config,
	conf *quic.Config, reqs []request, downloads string, early bool) error {
	var conn *quic.Conn
	var err error
	if early {
		conn, err = tr.DialEarly(ctx, raddr, tlsConf, conf)
	} else {
		conn, err = tr.Dial(ctx, raddr, tlsConf, conf)
	}
	if err != nil {
		return fmt.Errorf("dial %s: %w", raddr, err)
	}
	var h3conn *http3.ClientConn
	if alpn == alpnH3 {
		h3conn = (&http3.Transport{}).NewClientConn(conn)
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(reqs))
	for _, r := range reqs {
		wg.Add(1)
		go func(r request) {
			defer wg.Done()
			var err error
			if h3conn != nil {
				err = downloadH3(ctx, h3conn, r, downloads, early)
			} else {
				err = download(ctx, conn, r, downloads)
			}
			if err != nil {
				errs <- fmt.Errorf("%s: %w", r.url, err)
			}
		}(r)
	}
	wg.Wait()
	close(errs)
	st := conn.ConnectionState()
	log.Printf("connection done: version %s, cipher %s, resumed %v, 0-RTT %v",
		st.Version, tls.CipherSuiteName(st.TLS.CipherSuite), st.TLS.DidResume, st.Used0RTT)
	if early && !st.Used0RTT {
		log.Printf("warning: 0-RTT was not used")
	}
	// Application error codes: H3_NO_ERROR / H3_INTERNAL_ERROR for HTTP/3, 0 / 1 for hq.
	var ok, failed quic.ApplicationErrorCode = 0, 1
	if h3conn != nil {
		ok, failed = quic.ApplicationErrorCode(http3.ErrCodeNoError), quic.ApplicationErrorCode(http3.ErrCodeInternalError)
	}
	if err := <-errs; err != nil {
		conn.CloseWithError(failed, "download failed")
		return err
	}
	// Wait briefly so that a session ticket sent after the handshake is surely processed.
	if !early && !st.TLS.DidResume {
		time.Sleep(50 * time.Millisecond)
	}
	return conn.CloseWithError(ok, "")
}

// downloadH3 GETs r over HTTP/3 (in 0-RTT when early) and saves the body.
func downloadH3(ctx context.Context, cc *http3.ClientConn, r request, downloads string, early bool) error {
	method := http.MethodGet
	if early {
		method = http3.MethodGet0RTT
	}
	req, err := http.NewRequestWithContext(ctx, method, r.url.String(), nil)
	if err != nil {
		return err
	}
	resp, err := cc.RoundTrip(req)
	if err != nil {
		return fmt.Errorf("request: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %s", resp.Status)
	}
	return saveBody(resp.Body, filepath.Join(downloads, r.name))
}

func download(ctx context.Context, conn *quic.Conn, r request, downloads string) error {
	str, err := conn.OpenStreamSync(ctx)
	if err != nil {
		return fmt.Errorf("opening stream: %w", err)
	}
	p := r.url.EscapedPath()
	if p == "" {
		p = "/"
	}
	if _, err := fmt.Fprintf(str, "GET %s\r\n", p); err != nil {
		return fmt.Errorf("sending request: %w", err)
	}
	if err := str.Close(); err != nil {
		return err
	}
	return saveBody(str, filepath.Join(downloads, r.name))
}

func saveBody(body io.Reader, name string) error {
	f, err := os.Create(name)
	if err != nil {
		return err
	}
	w := bufio.NewWriterSize(f, 64<<10)
	if _, err := io.Copy(w, body); err != nil {
		f.Close()
		return fmt.Errorf("reading response: %w", err)
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
