//! Reading files to send: one blocking task per file reads it in 256 KiB chunks and hands
//! them over a short channel, instead of a `tokio::fs` blocking-pool job per 64 KiB read;
//! each chunk is read straight into the `Bytes` that the sender queues, without a copy or a
//! zeroed buffer.

use std::io::{self, Read};

use bytes::Bytes;
use tokio::sync::mpsc;

/// Bytes per read: large enough that the hand-over costs little per byte, small enough that
/// the chunks waiting (the channel's two and the one being read) stay under a megabyte.
const CHUNK: usize = 256 * 1024;
/// Chunks read ahead of the sender.
const AHEAD: usize = 2;

/// A file's contents as a stream of chunks. The reader starts on the first `next` and stops
/// when this is dropped (its next hand-over fails).
pub struct FileChunks {
    state: State,
}

enum State {
    Idle(std::fs::File, u64),
    Reading(mpsc::Receiver<io::Result<Bytes>>),
    Done,
}

impl FileChunks {
    /// Streams the first `len` bytes of `file` (its length when it was opened). A file that
    /// turns out shorter ends with `UnexpectedEof`.
    pub fn new(file: std::fs::File, len: u64) -> Self {
        Self {
            state: State::Idle(file, len),
        }
    }

    /// The next chunk; `None` once `len` bytes were returned.
    pub async fn next(&mut self) -> Option<io::Result<Bytes>> {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }

    /// Polling form of [`next`](Self::next), for `http_body::Body`.
    pub fn poll_next(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<io::Result<Bytes>>> {
        use std::task::Poll;
        if let State::Idle(..) = self.state {
            let State::Idle(file, len) = std::mem::replace(&mut self.state, State::Done) else {
                unreachable!("checked above")
            };
            if len == 0 {
                return Poll::Ready(None);
            }
            let (tx, rx) = mpsc::channel(AHEAD);
            tokio::task::spawn_blocking(move || read_into(file, len, &tx));
            self.state = State::Reading(rx);
        }
        let State::Reading(rx) = &mut self.state else {
            return Poll::Ready(None);
        };
        match rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(chunk))) => Poll::Ready(Some(Ok(chunk))),
            Poll::Ready(Some(Err(e))) => {
                self.state = State::Done;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                self.state = State::Done;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Reads `len` bytes of `file` in chunks into `tx`; returns when done, on an error (sent on),
/// or when the receiver is gone.
fn read_into(mut file: std::fs::File, len: u64, tx: &mpsc::Sender<io::Result<Bytes>>) {
    let mut left = len;
    while left > 0 {
        let want = left.min(CHUNK as u64);
        // `read_to_end` fills the spare capacity without zeroing it first; `take` stops it
        // at `want` without a read past the end.
        let mut buf = Vec::with_capacity(want as usize);
        let chunk = match file.by_ref().take(want).read_to_end(&mut buf) {
            Ok(n) if n as u64 == want => Ok(Bytes::from(buf)),
            Ok(_) => Err(io::ErrorKind::UnexpectedEof.into()),
            Err(e) => Err(e),
        };
        let failed = chunk.is_err();
        if tx.blocking_send(chunk).is_err() || failed {
            return; // the response was dropped, or the read failed
        }
        left -= want;
    }
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_file_comes_back_whole_in_large_chunks() {
        let data: Vec<u8> = (0..CHUNK * 3 + 1234).map(|i| (i * 7 % 251) as u8).collect();
        let (path, f) = temp_file("whole", &data);
        let mut chunks = FileChunks::new(f, data.len() as u64);
        let mut got = Vec::new();
        let mut sizes = Vec::new();
        while let Some(c) = chunks.next().await {
            let c = c.unwrap();
            sizes.push(c.len());
            got.extend_from_slice(&c);
        }
        std::fs::remove_file(path).unwrap();
        assert_eq!(got, data);
        assert_eq!(sizes, [CHUNK, CHUNK, CHUNK, 1234]);
        assert!(chunks.next().await.is_none(), "stays finished");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_file_that_shrank_ends_with_an_error() {
        let (path, f) = temp_file("short", b"0123456789");
        let mut chunks = FileChunks::new(f, 20);
        let first = chunks.next().await.unwrap();
        std::fs::remove_file(path).unwrap();
        assert_eq!(
            first.unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof,
            "10 of the 20 bytes announced"
        );
        assert!(chunks.next().await.is_none());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_empty_file_has_no_chunks() {
        let (path, f) = temp_file("empty", b"");
        let mut chunks = FileChunks::new(f, 0);
        assert!(chunks.next().await.is_none());
        std::fs::remove_file(path).unwrap();
    }
}
