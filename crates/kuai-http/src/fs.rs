//! Static files: [`StaticDir`] maps request paths to files below a root, [`FileChunks`] reads
//! them to send.
//!
//! Files are read in 256 KiB chunks straight into the `Bytes` that the sender queues (no copy,
//! no zeroed buffer where it can be helped); a chunk's memory is read into again once the
//! sender has let go of it, so a long download touches a handful of buffers, not a fresh
//! mapping per chunk.
//!
//! On Linux a chunk the page cache holds is read on the sending task itself, with
//! `preadv2(RWF_NOWAIT)`, which never waits for the disk: only a miss goes to a blocking
//! task. Files on a memory filesystem (tmpfs, ramfs; `RWF_NOWAIT` is not supported there)
//! are read directly too, since their pages are memory. Elsewhere one blocking task per file
//! reads ahead and hands chunks over a short channel. Either way a gigabyte costs about 4,000
//! reads instead of the 16,000 blocking-pool jobs and copies of `tokio::fs` at 64 KiB, and a
//! cached file none of the thread hand-overs, which cost about a fifth of the server's CPU
//! in a 1 GiB HTTP/3 download (wake-ups bouncing the work between the runtime's workers).

use std::future::Future;
use std::io::{self, Read};
use std::path::{Component, Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use tokio::task::JoinHandle;

/// A directory whose regular files are served.
///
/// Only regular files below the root are opened: the request path is percent-decoded one
/// segment at a time and refused if a segment is `..`, starts with a dot (dotfiles and
/// dot-directories such as `.git`), or holds `/`, `\` or NUL once decoded; a symlink is
/// followed only when its target is below the root and not a dotfile; FIFOs, sockets and
/// devices are refused before being opened, and the file is opened without blocking or
/// following a symlink and checked again through its descriptor. A directory stands for its
/// `index.html`.
#[derive(Debug, Clone)]
pub struct StaticDir {
    root: PathBuf,
    /// The root (absolute, without symlinks) and whether it is on a memory filesystem
    /// (tmpfs, ramfs), found once; `None` when the root could not be resolved at start or
    /// goes through a symlink (it is then resolved per request).
    resolved: Option<Arc<(PathBuf, bool)>>,
    /// The resolved root's directory, for [`open_beneath`] (Linux).
    #[cfg(target_os = "linux")]
    root_fd: Option<Arc<RootDir>>,
}

/// The root directory held open, and checked again (at most once a second) to still be
/// what its path names: a deploy that moves a new tree into the root's place
/// (`mv www www.old && mv www.new www`) is served from the next check on, not the old
/// tree for good.
#[cfg(target_os = "linux")]
#[derive(Debug)]
struct RootDir {
    path: PathBuf,
    fd: std::sync::RwLock<Arc<std::os::fd::OwnedFd>>,
    epoch: std::time::Instant,
    /// When the path was last compared with the descriptor (ms since `epoch`).
    checked: std::sync::atomic::AtomicU64,
}

#[cfg(target_os = "linux")]
impl RootDir {
    fn open(path: &Path) -> Option<Self> {
        Some(Self {
            fd: std::sync::RwLock::new(Arc::new(open_directory(path)?)),
            path: path.to_owned(),
            epoch: std::time::Instant::now(),
            checked: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The root's directory as its path names it now.
    fn current(&self) -> Arc<std::os::fd::OwnedFd> {
        use std::sync::atomic::Ordering::Relaxed;
        let now = self.epoch.elapsed().as_millis() as u64;
        let last = self.checked.load(Relaxed);
        let held = self.fd.read().unwrap_or_else(|e| e.into_inner()).clone();
        if now < last + 1000
            || self
                .checked
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_err()
        {
            return held;
        }
        let same = match (rustix::fs::stat(&self.path), rustix::fs::fstat(&*held)) {
            (Ok(a), Ok(b)) => a.st_dev == b.st_dev && a.st_ino == b.st_ino,
            _ => false,
        };
        if same {
            return held;
        }
        match open_directory(&self.path) {
            Some(fd) => {
                let fd = Arc::new(fd);
                *self.fd.write().unwrap_or_else(|e| e.into_inner()) = fd.clone();
                fd
            }
            None => held,
        }
    }
}

#[cfg(target_os = "linux")]
fn open_directory(path: &Path) -> Option<std::os::fd::OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    rustix::fs::open(
        path,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()
}

/// A request path as a path below a root ([`RelativePath::parse`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelativePath {
    /// The decoded path, with only normal components.
    pub path: PathBuf,
    /// Whether the request path ended with `/` (it names a directory).
    pub directory: bool,
}

impl RelativePath {
    /// `path` (a request path without its query) as a path below a root; `None` for
    /// anything that could leave the root or name a dotfile, and for a malformed `%`
    /// escape or one that decodes to something other than UTF-8.
    pub fn parse(path: &str) -> Option<Self> {
        let mut out = PathBuf::new();
        let mut directory = false;
        for raw in path.split('/') {
            directory = raw.is_empty();
            let segment = percent_decode(raw)?;
            match segment.as_str() {
                "" | "." => continue,
                ".." => return None,
                s if s.starts_with('.') || s.contains(['/', '\\', '\0']) => return None,
                s => out.push(s),
            }
        }
        Some(Self {
            path: out,
            directory,
        })
    }
}

impl StaticDir {
    /// Serves the files below `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        // Kept only when the root's path holds no symlink: one that does (a `current`
        // link flipped at each deploy) is resolved again for every request.
        let resolved = root
            .canonicalize()
            .ok()
            .filter(|real| std::path::absolute(&root).is_ok_and(|abs| abs == *real))
            .map(|real| {
                let memory = std::fs::File::open(&real).is_ok_and(|d| memory_filesystem(&d));
                Arc::new((real, memory))
            });
        #[cfg(target_os = "linux")]
        let root_fd = resolved
            .as_ref()
            .and_then(|r| RootDir::open(&r.0).map(Arc::new));
        Self {
            root,
            resolved,
            #[cfg(target_os = "linux")]
            root_fd,
        }
    }

    /// [`open_beneath`] where it can decide, else [`open_below`].
    fn open_resolved(&self, root: &Path, rel: &RelativePath) -> Option<Opened> {
        #[cfg(target_os = "linux")]
        if let Some(dir) = &self.root_fd
            && let Ok(found) = open_beneath(&dir.current(), rel)
        {
            return found;
        }
        open_below(root, rel)
    }

    /// The directory served.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Opens the file that a request path (its query and fragment are cut off) names: on a
    /// blocking task, or at once when the root is on a memory filesystem (nothing there
    /// waits for a disk); `None` when it is missing or must not be served (the two are not
    /// told apart, so a client learns nothing about what it may not read), and for a
    /// directory named without its final `/` (see [`find`](Self::find)).
    pub async fn open(&self, path: &str) -> Option<FileChunks> {
        match self.find(path).await? {
            Found::File(f) => Some(f),
            Found::Directory => None,
        }
    }

    /// What a request path (its query and fragment are cut off) names, as
    /// [`open`](Self::open) finds it, telling a directory named without its final `/` apart.
    pub async fn find(&self, path: &str) -> Option<Found> {
        let path = path.split(['?', '#']).next().unwrap_or("");
        let rel = RelativePath::parse(path)?;
        let opened = match &self.resolved {
            Some(r) if r.1 => self.open_resolved(&r.0, &rel)?,
            Some(r) => {
                let (r, this) = (r.clone(), self.clone());
                tokio::task::spawn_blocking(move || this.open_resolved(&r.0, &rel))
                    .await
                    .ok()??
            }
            None => {
                let root = self.root.clone();
                tokio::task::spawn_blocking(move || open_below(&root.canonicalize().ok()?, &rel))
                    .await
                    .ok()??
            }
        };
        Some(match opened {
            Opened::File(file, len) => Found::File(FileChunks::new(file, len)),
            Opened::Directory => Found::Directory,
        })
    }
}

/// What a request path names below a [`StaticDir`]'s root.
#[non_exhaustive]
pub enum Found {
    /// A regular file (for a path ending in `/`, the directory's `index.html`).
    File(FileChunks),
    /// A directory named without its final `/`. Its index is not served under that name:
    /// the relative links in it would resolve against the parent. The client should be
    /// sent to the name with the `/` (as nginx and Apache do, with a 301).
    Directory,
}

impl std::fmt::Debug for Found {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Found::File(c) => f.debug_tuple("File").field(&c.len()).finish(),
            Found::Directory => f.write_str("Directory"),
        }
    }
}

/// What [`open_below`] and [`open_beneath`] found.
enum Opened {
    File(std::fs::File, u64),
    Directory,
}

/// The media type for a request path, by its extension (ASCII case-insensitive); a path
/// ending in `/` is a directory's `index.html`. Anything else is `application/octet-stream`.
pub fn content_type(path: &str) -> &'static str {
    if path.is_empty() || path.ends_with('/') {
        return "text/html; charset=utf-8";
    }
    let name = path.rsplit('/').next().unwrap_or(path);
    let Some((_, ext)) = name.rsplit_once('.') else {
        return "application/octet-stream";
    };
    let ext = ext.to_ascii_lowercase();
    match ext.as_str() {
        "html" | "htm" => "text/html; charset=utf-8",
        "txt" => "text/plain; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "json" | "map" => "application/json",
        "xml" => "application/xml",
        "wasm" => "application/wasm",
        "pdf" => "application/pdf",
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "svg" => "image/svg+xml",
        "webp" => "image/webp",
        "avif" => "image/avif",
        "ico" => "image/vnd.microsoft.icon",
        "woff" => "font/woff",
        "woff2" => "font/woff2",
        "mp4" => "video/mp4",
        "webm" => "video/webm",
        "mp3" => "audio/mpeg",
        _ => "application/octet-stream",
    }
}

/// `%XX` escapes decoded (RFC 3986 §2.1); `None` for a malformed escape or a result that is
/// not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    if !s.contains('%') {
        return Some(s.to_owned());
    }
    String::from_utf8(percent_decode_bytes(s)?).ok()
}

/// `s` with its `%XX` escapes decoded; `None` for a `%` not followed by two hex digits.
pub(crate) fn percent_decode_bytes(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3)?;
            // Two hex digits exactly: from_str_radix alone would take "+1".
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                return None;
            }
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Some(out)
}

/// Opens `rel` below `root` (resolved) if it is, once every symlink is resolved, a regular
/// file still below the root with no dot-named component; a directory stands for its
/// `index.html` (named with its final `/`). Blocking unless the root is on a memory
/// filesystem.
fn open_below(root: &Path, rel: &RelativePath) -> Option<Opened> {
    let mut real = checked_real_path(root, &root.join(&rel.path))?;
    let meta = std::fs::metadata(&real).ok()?;
    if meta.is_dir() && !rel.directory {
        return Some(Opened::Directory);
    } else if meta.is_dir() {
        real = checked_real_path(root, &real.join("index.html"))?;
    } else if rel.directory {
        return None;
    }
    // Regular files only: a FIFO would block the open, a device could be endless or act
    // on being opened, a socket cannot be read.
    if !std::fs::metadata(&real).ok()?.is_file() {
        return None;
    }
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // Should the file have been swapped for a symlink or a FIFO since the checks, the
        // open fails or returns at once instead of following or blocking.
        options.custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW);
    }
    let file = options.open(&real).ok()?;
    // O_NOFOLLOW covers the last component only: a directory on the way swapped for a
    // symlink between the checks and the open would take it elsewhere. Where the kernel
    // tells the path it opened, that path must be the one checked.
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        if let Ok(opened) = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
            && opened != real
        {
            return None;
        }
    }
    let meta = file.metadata().ok()?;
    meta.is_file().then(|| Opened::File(file, meta.len()))
}

/// [`open_below`]'s answer in a few system calls where no symlink is on the way (Linux 5.6+):
/// `openat2` below the root's descriptor refusing any symlink (`RESOLVE_NO_SYMLINKS`) and
/// any escape (`RESOLVE_BENEATH`). The path's segments were checked for dots when parsed,
/// and without symlinks the path is the real one. The file is first found with `O_PATH`
/// (which opens nothing: a FIFO or a device is refused before being opened), then opened
/// and checked to be the same inode. `Err` when it cannot decide: a symlink on the way, or
/// no `openat2`; [`open_below`] then resolves the path as before.
#[cfg(target_os = "linux")]
fn open_beneath(root: &std::os::fd::OwnedFd, rel: &RelativePath) -> Result<Option<Opened>, ()> {
    use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
    use rustix::io::Errno;
    use std::os::fd::{AsFd, BorrowedFd};
    let how = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    let open = |dir: BorrowedFd<'_>, path: &Path, flags: OFlags| match rustix::fs::openat2(
        dir,
        path,
        flags | OFlags::CLOEXEC,
        Mode::empty(),
        how,
    ) {
        Ok(fd) => rustix::fs::fstat(&fd)
            .map(|st| Some((fd, st)))
            .map_err(|_| ()),
        Err(Errno::LOOP | Errno::NOSYS | Errno::XDEV | Errno::AGAIN | Errno::PERM) => Err(()),
        Err(_) => Ok(None),
    };
    let kind = |st: &rustix::fs::Stat| FileType::from_raw_mode(st.st_mode);
    let here = if rel.path.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel.path.as_path()
    };
    let Some((found, st)) = open(root.as_fd(), here, OFlags::PATH)? else {
        return Ok(None);
    };
    // A directory stands for its index.html, opened below the directory found.
    let index = Path::new("index.html");
    let (dir_fd, name, st) = if kind(&st) == FileType::Directory && !rel.directory {
        return Ok(Some(Opened::Directory));
    } else if kind(&st) == FileType::Directory {
        let Some((_, st)) = open(found.as_fd(), index, OFlags::PATH)? else {
            return Ok(None);
        };
        (Some(found), index, st)
    } else if rel.directory {
        return Ok(None);
    } else {
        (None, here, st)
    };
    // Regular files only (see `open_below`).
    if kind(&st) != FileType::RegularFile {
        return Ok(None);
    }
    let dir = match &dir_fd {
        Some(d) => d.as_fd(),
        None => root.as_fd(),
    };
    let Some((file, now)) = open(
        dir,
        name,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOFOLLOW,
    )?
    else {
        return Ok(None);
    };
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) || kind(&now) != FileType::RegularFile {
        return Ok(None);
    }
    Ok(Some(Opened::File(
        std::fs::File::from(file),
        now.st_size as u64,
    )))
}

/// `path` with every symlink resolved, if that is below `root` (itself resolved) and no
/// component below the root starts with a dot.
fn checked_real_path(root: &Path, path: &Path) -> Option<PathBuf> {
    let real = path.canonicalize().ok()?;
    let below = real.strip_prefix(root).ok()?;
    let dotted = below.components().any(|c| match c {
        Component::Normal(name) => name.as_encoded_bytes().first() == Some(&b'.'),
        _ => true,
    });
    (!dotted).then_some(real)
}

/// Bytes per read: large enough that the hand-over to a blocking task costs little per byte.
const CHUNK: usize = 256 * 1024;

/// A file's contents as a stream of chunks. Reading starts on the first `next`.
pub struct FileChunks {
    file: Arc<std::fs::File>,
    len: u64,
    state: State,
}

enum State {
    Idle(u64),
    /// Read by the task that polls (page-cache hits, or a memory filesystem), or a chunk
    /// at a time by a blocking task.
    Direct(Direct),
    Done,
}

struct Direct {
    file: Arc<std::fs::File>,
    left: u64,
    /// tmpfs or ramfs: plain reads never wait for a disk.
    memory: bool,
    /// The filesystem cannot tell whether a read would wait (no `RWF_NOWAIT`: NFS, FUSE;
    /// every system but Linux): each chunk is read by a blocking task of its own, so a
    /// slow client holds no thread while it takes its time.
    blocking: bool,
    /// A chunk the page cache did not hold, being read by a blocking task.
    pending: Option<JoinHandle<io::Result<Vec<u8>>>>,
    /// Chunks handed to the sender, oldest first: once the sender has let go of one (its
    /// data was acknowledged), its memory takes the next read.
    spent: Spent,
}

/// Buffers of chunks handed out, kept to be read into again.
///
/// A fresh 256 KiB buffer per chunk costs page faults and zeroed pages (the allocator hands
/// memory this large back to the kernel), and on the page-cache path a zeroing of its own;
/// a buffer the sender has dropped is still mapped, initialised and warm in the cache.
#[derive(Default)]
struct Spent(std::collections::VecDeque<Bytes>);

/// Chunks whose buffers are kept: enough for what a sender holds unacknowledged on a fast
/// path (the send-ahead limit and a loopback flight).
const SPENT: usize = 6;
/// Of those, the most whose buffers only this pool holds.
const SPENT_FREE: usize = 2;

impl Spent {
    /// A buffer of `want` initialised bytes: the oldest chunk the sender has let go of, or a
    /// new one.
    fn buffer(&mut self, want: usize) -> Vec<u8> {
        if self.0.front().is_some_and(Bytes::is_unique)
            && let Some(Ok(m)) = self.0.pop_front().map(Bytes::try_into_mut)
        {
            let mut v = Vec::from(m);
            if v.capacity() >= want {
                // Initialised already: shortening or growing within what was read before
                // writes nothing.
                v.resize(want, 0);
                return v;
            }
        }
        vec![0; want]
    }

    /// Keeps a handle on `chunk`'s buffer (dropping the oldest when full: the sender still
    /// holds it, and frees it itself). Of the buffers the sender has let go of by now, two
    /// are kept, enough for the next reads. (Those it lets go of later stay until the next
    /// read or the body's end: at most `SPENT` chunks for a response that stalls, which the
    /// server's send timeout ends.)
    fn keep(&mut self, chunk: &Bytes) {
        if self.0.len() == SPENT {
            self.0.pop_front();
        }
        self.0.push_back(chunk.clone());
        let mut free = self.0.iter().filter(|b| b.is_unique()).count();
        while free > SPENT_FREE {
            if let Some(i) = self.0.iter().position(Bytes::is_unique) {
                self.0.remove(i);
            }
            free -= 1;
        }
    }
}

impl FileChunks {
    /// Streams the first `len` bytes of `file` (its length when it was opened). A file that
    /// turns out shorter ends with `UnexpectedEof`.
    pub fn new(file: std::fs::File, len: u64) -> Self {
        Self {
            file: Arc::new(file),
            len,
            state: State::Idle(len),
        }
    }

    /// The open file's metadata (which file it is, when it was modified).
    pub fn metadata(&self) -> io::Result<std::fs::Metadata> {
        self.file.metadata()
    }

    /// The length given to [`new`](Self::new): what the response announces.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// The `len` bytes from `offset` instead (a byte range, for a 206 response); only
    /// before the first chunk was asked for.
    pub fn range(mut self, offset: u64, len: u64) -> io::Result<Self> {
        use std::io::{Seek, SeekFrom};
        if !matches!(self.state, State::Idle(_)) {
            return Err(io::Error::other("the file is already being read"));
        }
        (&*self.file).seek(SeekFrom::Start(offset))?;
        self.len = len;
        self.state = State::Idle(len);
        Ok(self)
    }

    /// The answer to `method` (GET or HEAD) with `request` headers for this file
    /// ([`crate::answer()`]: validators, conditional requests, a byte range), and the chunks to
    /// send, if any (narrowed to the range for a 206).
    pub fn answer(
        self,
        method: &http::Method,
        request: &http::HeaderMap,
        content_type: &str,
    ) -> io::Result<(crate::FileAnswer, Option<Self>)> {
        let info = match self.metadata() {
            Ok(m) => crate::FileInfo {
                len: self.len,
                modified: m.modified().ok(),
            },
            Err(_) => crate::FileInfo {
                len: self.len,
                modified: None,
            },
        };
        let a = crate::answer(method, request, &info, content_type);
        let body = match a.body {
            Some((0, len)) if len == self.len => Some(self),
            Some((offset, len)) => Some(self.range(offset, len)?),
            None => None,
        };
        Ok((a, body))
    }

    /// Whether the length given was zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The next chunk; `None` once `len` bytes were returned.
    pub async fn next(&mut self) -> Option<io::Result<Bytes>> {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }

    /// Polling form of [`next`](Self::next), for `http_body::Body`.
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        if let State::Idle(len) = self.state {
            if len == 0 {
                self.state = State::Done;
                return Poll::Ready(None);
            }
            let file = self.file.clone();
            self.state = State::Direct(Direct {
                memory: memory_filesystem(&file),
                blocking: !cfg!(target_os = "linux"),
                file,
                left: len,
                pending: None,
                spent: Spent::default(),
            });
        }
        let item = match &mut self.state {
            State::Direct(d) => ready!(d.poll_next(cx)),
            State::Idle(..) | State::Done => None,
        };
        if !matches!(item, Some(Ok(_))) {
            self.state = State::Done;
        }
        Poll::Ready(item)
    }
}

impl Direct {
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        if let Some(read) = &mut self.pending {
            let done = ready!(Pin::new(read).poll(cx));
            self.pending = None;
            let chunk = done.unwrap_or_else(|e| Err(io::Error::other(e)));
            return Poll::Ready(Some(self.take(chunk)));
        }
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let want = self.left.min(CHUNK as u64);
        let buf = self.spent.buffer(want as usize);
        if self.memory {
            let chunk = read_chunk(&self.file, buf);
            return Poll::Ready(Some(self.take(chunk)));
        }
        let buf = if self.blocking {
            buf
        } else {
            match read_cached(&self.file, buf) {
                Cached::Hit(chunk) => return Poll::Ready(Some(self.take(chunk))),
                Cached::Miss(buf) => buf,
                Cached::Unsupported(buf) => {
                    // This filesystem cannot say whether a read would wait.
                    self.blocking = true;
                    buf
                }
            }
        };
        let file = self.file.clone();
        self.pending = Some(tokio::task::spawn_blocking(move || read_chunk(&file, buf)));
        self.poll_next(cx)
    }

    /// Counts a chunk read; an empty one means the file ended early.
    fn take(&mut self, chunk: io::Result<Vec<u8>>) -> io::Result<Bytes> {
        let chunk = chunk?;
        if chunk.is_empty() {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.left = self.left.saturating_sub(chunk.len() as u64);
        let chunk = Bytes::from(chunk);
        self.spent.keep(&chunk);
        Ok(chunk)
    }
}

/// Fills `buf` from the file's position; shorter only at the file's end.
fn read_chunk(mut file: &std::fs::File, mut buf: Vec<u8>) -> io::Result<Vec<u8>> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(n);
    Ok(buf)
}

enum Cached {
    Hit(io::Result<Vec<u8>>),
    /// The page cache lacks the next bytes; the buffer is handed back.
    Miss(Vec<u8>),
    /// `RWF_NOWAIT` is not supported for this file; the buffer is handed back.
    Unsupported(Vec<u8>),
}

/// A read into `buf` from the file's position that never waits for the disk (`preadv2` with
/// `RWF_NOWAIT`, Linux 4.14): what the page cache holds of the next `buf.len()` bytes.
#[cfg(target_os = "linux")]
fn read_cached(file: &std::fs::File, mut buf: Vec<u8>) -> Cached {
    use rustix::io::{Errno, ReadWriteFlags};
    // Offset u64::MAX: read at the file's position and advance it, as read(2) does.
    let slices = &mut [io::IoSliceMut::new(&mut buf)];
    match rustix::io::preadv2(file, slices, u64::MAX, ReadWriteFlags::NOWAIT) {
        Ok(n) => {
            buf.truncate(n);
            Cached::Hit(Ok(buf))
        }
        Err(Errno::AGAIN) => Cached::Miss(buf),
        Err(Errno::OPNOTSUPP | Errno::INVAL | Errno::NOSYS) => Cached::Unsupported(buf),
        Err(Errno::INTR) => read_cached(file, buf),
        Err(e) => Cached::Hit(Err(e.into())),
    }
}

#[cfg(not(target_os = "linux"))]
fn read_cached(_: &std::fs::File, buf: Vec<u8>) -> Cached {
    Cached::Unsupported(buf)
}

/// Whether the file lives on tmpfs or ramfs (statfs(2) `f_type`), whose pages are memory.
#[cfg(target_os = "linux")]
fn memory_filesystem(file: &std::fs::File) -> bool {
    const TMPFS_MAGIC: u64 = 0x0102_1994;
    const RAMFS_MAGIC: u64 = 0x8584_58f6;
    rustix::fs::fstatfs(file).is_ok_and(|s| {
        #[allow(clippy::unnecessary_cast, clippy::useless_conversion)]
        let kind = s.f_type as u64;
        kind == TMPFS_MAGIC || kind == RAMFS_MAGIC
    })
}

#[cfg(not(target_os = "linux"))]
fn memory_filesystem(_: &std::fs::File) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn temp_file(name: &str, data: &[u8]) -> (std::path::PathBuf, std::fs::File) {
        let path = std::env::temp_dir().join(format!("kuai-files-{}-{name}", std::process::id()));
        std::fs::File::create(&path)
            .unwrap()
            .write_all(data)
            .unwrap();
        let f = std::fs::File::open(&path).unwrap();
        (path, f)
    }

    fn rel(p: &str) -> Option<(PathBuf, bool)> {
        RelativePath::parse(p).map(|r| (r.path, r.directory))
    }

    #[test]
    fn content_types_come_from_the_extension() {
        assert_eq!(content_type("/"), "text/html; charset=utf-8");
        assert_eq!(content_type("/docs/"), "text/html; charset=utf-8");
        assert_eq!(content_type("/a/INDEX.HTML"), "text/html; charset=utf-8");
        assert_eq!(content_type("/app.mjs"), "text/javascript; charset=utf-8");
        assert_eq!(content_type("/f.woff2"), "font/woff2");
        assert_eq!(content_type("/v1.2/readme"), "application/octet-stream");
        assert_eq!(content_type("/archive.tar.gz"), "application/octet-stream");
    }

    #[test]
    fn paths_stay_below_the_root() {
        let path = |p| rel(p).map(|(p, _)| p);
        assert_eq!(path("/a/b.txt"), Some(PathBuf::from("a/b.txt")));
        assert_eq!(path("/./x"), Some(PathBuf::from("x")));
        assert_eq!(path("/../etc/passwd"), None);
        assert_eq!(path("/a/../../x"), None);
        assert_eq!(path("/a/%2e%2e/%2e%2e/x"), None);
        assert_eq!(path("/%2F..%2Fx"), None);
        assert_eq!(path("/.git/config"), None);
        assert_eq!(path("/a\\..\\x"), None);
        assert_eq!(path("/a%00"), None);
        assert_eq!(path("/"), Some(PathBuf::new()));
        assert_eq!(rel("/a/"), Some((PathBuf::from("a"), true)));
        assert_eq!(rel("/a"), Some((PathBuf::from("a"), false)));
    }

    /// RFC 3986 §2.1: an escape is `%` and two hex digits; `%+1` is not one (found by the
    /// hq_request fuzz target's model).
    #[test]
    fn malformed_percent_escapes_are_refused() {
        assert_eq!(rel("/a%2f"), None, "a / in a segment");
        assert_eq!(rel("/a%41"), Some((PathBuf::from("aA"), false)));
        for bad in ["/a%+1", "/a%-1", "/a%4", "/a% 1", "/a%zz", "/%ff"] {
            assert_eq!(rel(bad), None, "{bad}");
        }
    }

    /// The openat2 way: regular files and a directory's index.html found in a few calls;
    /// FIFOs and paths out of the root refused; a symlink on the way left to the resolving
    /// way (`Err`), which follows it when its target stays below the root.
    #[cfg(target_os = "linux")]
    #[test]
    fn openat2_finds_refuses_or_defers() {
        let base = std::env::temp_dir().join(format!("kuai-beneath-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let root = base.join("root");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::write(root.join("a.txt"), b"aaa").unwrap();
        std::fs::write(root.join("sub/index.html"), b"<p>").unwrap();
        std::fs::write(base.join("outside.txt"), b"no").unwrap();
        std::os::unix::fs::symlink("a.txt", root.join("link")).unwrap();
        std::os::unix::fs::symlink(base.join("outside.txt"), root.join("out")).unwrap();
        let fifo = std::process::Command::new("mkfifo")
            .arg(root.join("fifo"))
            .status()
            .is_ok_and(|s| s.success());
        let dir = StaticDir::new(&root);
        let fd = dir.root_fd.as_ref().expect("root opened").current();
        let beneath = |p: &str| open_beneath(&fd, &RelativePath::parse(p).unwrap());
        // A file's length; `DIR` for a directory named without its `/`.
        const DIR: u64 = u64::MAX;
        let size = |o: Opened| match o {
            Opened::File(_, n) => n,
            Opened::Directory => DIR,
        };
        let len = |r: Result<Option<Opened>, ()>| r.map(|o| o.map(size));
        assert_eq!(len(beneath("/a.txt")), Ok(Some(3)));
        assert_eq!(len(beneath("/sub/")), Ok(Some(3)), "index.html");
        assert_eq!(len(beneath("/sub")), Ok(Some(DIR)));
        assert_eq!(
            len(beneath("/a.txt/")),
            Ok(None),
            "a file named as a directory"
        );
        assert_eq!(len(beneath("/missing")), Ok(None));
        assert_eq!(len(beneath("/")), Ok(None), "no index.html at the root");
        if fifo {
            assert_eq!(len(beneath("/fifo")), Ok(None), "refused without blocking");
        }
        assert_eq!(
            len(beneath("/link")),
            Err(()),
            "a symlink: the resolving way decides"
        );
        assert_eq!(len(beneath("/out")), Err(()));
        // And that way: in the root, followed; out of it, refused.
        let r = dir.resolved.as_ref().unwrap().0.clone();
        let resolved = |p: &str| dir.open_resolved(&r, &RelativePath::parse(p).unwrap());
        assert_eq!(resolved("/link").map(size), Some(3));
        assert!(resolved("/out").is_none());
        assert_eq!(
            open_below(&r, &RelativePath::parse("/sub").unwrap()).map(size),
            Some(DIR)
        );
        assert_eq!(
            open_below(&r, &RelativePath::parse("/sub/").unwrap()).map(size),
            Some(3)
        );
        let _ = std::fs::remove_dir_all(&base);
    }

    async fn collect(mut chunks: FileChunks) -> (Vec<u8>, Vec<usize>) {
        let mut got = Vec::new();
        let mut sizes = Vec::new();
        while let Some(c) = chunks.next().await {
            let c = c.unwrap();
            sizes.push(c.len());
            got.extend_from_slice(&c);
        }
        assert!(chunks.next().await.is_none(), "stays finished");
        (got, sizes)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_file_comes_back_whole_in_large_chunks() {
        let data: Vec<u8> = (0..CHUNK * 3 + 1234).map(|i| (i * 7 % 251) as u8).collect();
        let (path, f) = temp_file("whole", &data);
        let (got, sizes) = collect(FileChunks::new(f, data.len() as u64)).await;
        std::fs::remove_file(path).unwrap();
        assert_eq!(got, data);
        assert_eq!(sizes, [CHUNK, CHUNK, CHUNK, 1234]);
    }

    /// The direct reads (from the page cache, from a memory filesystem, and a miss handed to
    /// a blocking task) and the reads of a blocking task per chunk give the same bytes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_way_of_reading_gives_the_same_bytes() {
        let data: Vec<u8> = (0..CHUNK * 2 + 99).map(|i| (i * 13 % 253) as u8).collect();
        let len = data.len() as u64;
        let (path, _) = temp_file("ways", &data);
        let open = || std::fs::File::open(&path).unwrap();
        let direct = |file: std::fs::File, memory: bool, blocking: bool| {
            let file = Arc::new(file);
            FileChunks {
                file: file.clone(),
                len,
                state: State::Direct(Direct {
                    file,
                    left: len,
                    memory,
                    blocking,
                    pending: None,
                    spent: Spent::default(),
                }),
            }
        };
        assert_eq!(
            collect(direct(open(), false, false)).await.0,
            data,
            "page cache"
        );
        assert_eq!(
            collect(direct(open(), true, false)).await.0,
            data,
            "plain reads"
        );
        #[cfg(target_os = "linux")]
        {
            // Evicted from the page cache, the first RWF_NOWAIT read misses (on filesystems
            // that support it) and a blocking task reads the chunk.
            let f = open();
            f.sync_all().unwrap();
            rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
            assert_eq!(
                collect(direct(f, false, false)).await.0,
                data,
                "after eviction"
            );
        }
        assert_eq!(
            collect(direct(open(), false, true)).await.0,
            data,
            "a blocking task per chunk"
        );
        std::fs::remove_file(path).unwrap();
    }

    /// A new tree moved into the root's place (`mv www www.old && mv www.new www`) is served
    /// from the next check of the root (a second at most), not the old tree for good.
    #[tokio::test]
    async fn a_root_replaced_by_a_deploy_is_served_anew() {
        let base = std::env::temp_dir().join(format!("kuai-files-{}-deploy", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let root = base.join("www");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("a.txt"), b"old").unwrap();
        let dir = StaticDir::new(&root);
        let read = |dir: StaticDir| async move {
            let mut f = dir.open("/a.txt").await.expect("found");
            f.next().await.unwrap().unwrap()
        };
        assert_eq!(&read(dir.clone()).await[..], b"old");
        let next = base.join("www.new");
        std::fs::create_dir_all(&next).unwrap();
        std::fs::write(next.join("a.txt"), b"new").unwrap();
        std::fs::rename(&root, base.join("www.old")).unwrap();
        std::fs::rename(&next, &root).unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
        assert_eq!(&read(dir.clone()).await[..], b"new");
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// At each read, the buffers of chunks the sender has let go of are kept two at most
    /// (all six were).
    #[tokio::test]
    async fn few_let_go_buffers_are_kept() {
        let data = vec![7u8; CHUNK * 8];
        let (path, f) = temp_file("keep", &data);
        let mut chunks = FileChunks::new(f, data.len() as u64);
        for _ in 0..6 {
            drop(chunks.next().await.unwrap().unwrap());
        }
        let State::Direct(d) = &chunks.state else {
            panic!("read directly")
        };
        let free = d.spent.0.iter().filter(|b| b.is_unique()).count();
        assert!(free <= SPENT_FREE, "{free} buffers kept for nothing");
        std::fs::remove_file(path).unwrap();
    }

    /// A chunk the sender has dropped lends its memory to a later read; one it still holds
    /// does not, and keeps its bytes.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn dropped_chunks_are_read_into_again() {
        let data: Vec<u8> = (0..CHUNK * 4).map(|i| (i * 11 % 249) as u8).collect();
        let (path, f) = temp_file("reuse", &data);
        let mut chunks = FileChunks::new(f, data.len() as u64);
        let first = chunks.next().await.unwrap().unwrap();
        let first_at = first.as_ptr();
        let held = chunks.next().await.unwrap().unwrap();
        drop(first);
        // Whatever the allocator hands out next cannot be the memory the pool kept.
        let other = std::hint::black_box(vec![1u8; CHUNK]);
        let third = chunks.next().await.unwrap().unwrap();
        assert_eq!(
            third.as_ptr(),
            first_at,
            "the dropped chunk's buffer is reused"
        );
        assert_ne!(other.as_ptr(), first_at);
        assert_eq!(
            &held[..],
            &data[CHUNK..2 * CHUNK],
            "a held chunk is left alone"
        );
        assert_eq!(&third[..], &data[2 * CHUNK..3 * CHUNK]);
        let fourth = chunks.next().await.unwrap().unwrap();
        assert_ne!(fourth.as_ptr(), held.as_ptr());
        assert_eq!(&fourth[..], &data[3 * CHUNK..]);
        assert!(chunks.next().await.is_none());
        std::fs::remove_file(path).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_range_reads_only_its_bytes() {
        let data: Vec<u8> = (0..CHUNK * 2).map(|i| (i % 241) as u8).collect();
        let (path, f) = temp_file("range", &data);
        let start = CHUNK as u64 - 10;
        let chunks = FileChunks::new(f, data.len() as u64)
            .range(start, 30)
            .unwrap();
        assert_eq!(chunks.len(), 30);
        let (got, _) = collect(chunks).await;
        std::fs::remove_file(path).unwrap();
        assert_eq!(got, &data[start as usize..start as usize + 30]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_file_that_shrank_ends_with_an_error() {
        let (path, f) = temp_file("short", b"0123456789");
        let mut chunks = FileChunks::new(f, 20);
        // What is there may come first (the direct reads pass on a short chunk; the reader
        // ahead refuses it), then the error, once.
        let mut got = Vec::new();
        let err = loop {
            match chunks.next().await.expect("an error before the end") {
                Ok(c) => got.extend_from_slice(&c),
                Err(e) => break e,
            }
        };
        std::fs::remove_file(path).unwrap();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "10 of 20 bytes");
        assert!(got.len() <= 10);
        assert!(chunks.next().await.is_none());
    }

    /// A root reached through a symlink follows the link when it moves (a deploy's
    /// `current` flipped to a new release); a root without one is resolved once.
    #[cfg(unix)]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_symlinked_root_follows_its_link() {
        let base = std::env::temp_dir().join(format!("kuai-fs-flip-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        for (d, text) in [("a", "release a"), ("b", "release b")] {
            std::fs::create_dir_all(base.join(d)).unwrap();
            std::fs::write(base.join(d).join("x.txt"), text).unwrap();
        }
        let current = base.join("current");
        std::os::unix::fs::symlink(base.join("a"), &current).unwrap();
        let dir = StaticDir::new(&current);
        assert!(
            dir.resolved.is_none(),
            "a symlinked root is resolved per request"
        );
        assert_eq!(
            collect(dir.open("/x.txt").await.unwrap()).await.0,
            b"release a"
        );
        std::fs::remove_file(&current).unwrap();
        std::os::unix::fs::symlink(base.join("b"), &current).unwrap();
        assert_eq!(
            collect(dir.open("/x.txt").await.unwrap()).await.0,
            b"release b"
        );
        assert!(StaticDir::new(base.join("a")).resolved.is_some());
        let _ = std::fs::remove_dir_all(&base);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_empty_file_has_no_chunks() {
        let (path, f) = temp_file("empty", b"");
        let mut chunks = FileChunks::new(f, 0);
        assert!(chunks.next().await.is_none());
        std::fs::remove_file(path).unwrap();
    }
}
