//! Unit tests of the io_uring relay's bookkeeping.

use std::io::Write as _;

use super::*;

/// A connected pair on loopback: (the peer that writes, our side that reads).
fn pair() -> (std::net::TcpStream, std::net::TcpStream) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (ours, _) = l.accept().unwrap();
    (peer, ours)
}

/// Waits (bounded) until `ours` has `n` bytes queued, and its peer's FIN too if `fin`.
fn queued(ours: &std::net::TcpStream, n: usize, fin: bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut probe = vec![0u8; n + 1];
    loop {
        use nix::sys::socket::{MsgFlags, recv};
        let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
        let got = recv(ours.as_raw_fd(), &mut probe, flags).unwrap_or(0);
        // nix's PollFlags has no POLLRDHUP (the peer's FIN).
        let mut pfd = libc::pollfd {
            fd: ours.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, 0) };
        let closed = pfd.revents & libc::POLLRDHUP != 0;
        if got >= n && closed == fin {
            return;
        }
        assert!(Instant::now() < deadline, "data never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn read_to_fin_finds_a_fin_right_behind_the_data() {
    let (mut peer, ours) = pair();
    peer.write_all(b"reply").unwrap();
    peer.shutdown(std::net::Shutdown::Write).unwrap();
    queued(&ours, 5, true);
    let mut buf = [0u8; 64];
    // As if the ring's receive took the first two bytes: the rest and the FIN are found.
    let flags = nix::sys::socket::MsgFlags::empty();
    let first = nix::sys::socket::recv(ours.as_raw_fd(), &mut buf[..2], flags).unwrap();
    assert_eq!(first, 2);
    let (n, got) = read_to_fin(ours.as_fd(), &mut buf, 2);
    assert_eq!((n, got.unwrap()), (5, true));
    assert_eq!(&buf[..5], b"reply");
}

#[test]
fn read_to_fin_without_a_fin_returns_what_is_there_and_does_not_block() {
    let (mut peer, ours) = pair();
    ours.set_nonblocking(false).unwrap();
    peer.write_all(b"more").unwrap();
    queued(&ours, 4, false);
    let mut buf = [0u8; 64];
    let (n, got) = read_to_fin(ours.as_fd(), &mut buf, 0);
    assert_eq!((n, got.unwrap()), (4, false));
    // Nothing left: it returns at once (MSG_DONTWAIT) with no FIN.
    let (n, got) = read_to_fin(ours.as_fd(), &mut buf, 4);
    assert_eq!((n, got.unwrap()), (4, false));
}

#[test]
fn read_to_fin_keeps_the_data_in_front_of_a_reset() {
    let (mut peer, ours) = pair();
    peer.write_all(b"last").unwrap();
    queued(&ours, 4, false);
    // Abort with RST after the data, and wait (bounded) until it is in.
    SockRef::from(&peer)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(peer);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let events = nix::poll::PollFlags::POLLERR;
        let mut fds = [nix::poll::PollFd::new(ours.as_fd(), events)];
        let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO);
        if fds[0].revents().is_some_and(|r| r.contains(events)) {
            break;
        }
        assert!(Instant::now() < deadline, "no reset arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut buf = [0u8; 64];
    let (n, got) = read_to_fin(ours.as_fd(), &mut buf, 0);
    assert_eq!(&buf[..n], b"last");
    assert_eq!(
        got.unwrap_err().raw_os_error(),
        Some(libc::ECONNRESET),
        "the reset must come out after the data"
    );
}
