//! The ZeroMQ framing vLLM and SGLang use.
//!
//! - Live (PUB → SUB): `[topic, seq, payload]`, `seq` an 8-byte big-endian `u64` counting from 0.
//! - Replay request (DEALER → ROUTER): `["", start_seq]`; the ROUTER sees `[identity, "",
//!   start_seq]`.
//! - Replay replies (ROUTER → DEALER): one message per buffered batch with `seq >= start_seq`,
//!   oldest first, then an end marker whose `seq` is −1 (as a signed 8-byte big-endian
//!   integer, [`END_SEQ`]). Two shapes are in use, and both are read:
//!   - vLLM 0.32 and later (since its replay topic-frame fix) put the topic before the
//!     sequence: `["", topic, seq, payload]`, ending with `["", "", END_SEQ, ""]` — four
//!     frames at a DEALER;
//!   - SGLang and older vLLM send no topic: `["", seq, payload]`, ending with
//!     `["", END_SEQ, ""]`.
//!
//!   The empty delimiter frame is optional in both (a client that strips it sees one frame
//!   fewer). A reply's topic is not checked: a replay socket answers for its own publisher.

use bytes::Bytes;

/// The sequence frame of the replay end marker (−1).
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// The 8-byte big-endian frame of a sequence number.
pub fn seq_frame(seq: u64) -> Bytes {
    Bytes::copy_from_slice(&seq.to_be_bytes())
}

/// A sequence number from its frame; `None` unless it is exactly 8 bytes.
pub fn parse_seq(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

/// A live message split into (topic, seq, payload); `None` unless it has exactly three
/// frames and an 8-byte sequence frame.
pub fn split_live(frames: &[Bytes]) -> Option<(&Bytes, u64, &Bytes)> {
    match frames {
        [topic, seq, payload] => parse_seq(seq).map(|s| (topic, s, payload)),
        _ => None,
    }
}

/// One replay reply as the DEALER receives it, in either shape (with or without the topic
/// frame; the empty delimiter optional): `Some(None)` for the end marker,
/// `Some(Some((seq, payload)))` for a message, `None` when malformed.
pub fn split_reply(frames: &[Bytes]) -> Option<Option<(u64, &Bytes)>> {
    let (seq, payload) = match frames {
        // vLLM 0.32+: ["", topic, seq, payload] (the end marker's topic frame is empty).
        [delim, _topic, seq, payload] if delim.is_empty() => (seq, payload),
        // SGLang, older vLLM: ["", seq, payload]; vLLM 0.32+ without the delimiter:
        // [topic, seq, payload]. Either way the sequence is the second frame.
        [_, seq, payload] => (seq, payload),
        [seq, payload] => (seq, payload),
        _ => return None,
    };
    if seq.as_ref() == END_SEQ {
        return Some(None);
    }
    parse_seq(seq).map(|s| Some((s, payload)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_reject_bad_shapes() {
        assert_eq!(parse_seq(&seq_frame(258)), Some(258));
        assert_eq!(seq_frame(1).as_ref(), &[0, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(parse_seq(&[1, 2, 3]), None);
        let live = [Bytes::from("t"), seq_frame(7), Bytes::from("p")];
        assert_eq!(split_live(&live).map(|(_, s, _)| s), Some(7));
        assert!(split_live(&live[..2]).is_none());
        let end = [Bytes::new(), Bytes::copy_from_slice(&END_SEQ), Bytes::new()];
        assert_eq!(split_reply(&end), Some(None));
        let reply = [Bytes::new(), seq_frame(3), Bytes::from("p")];
        assert_eq!(split_reply(&reply).flatten().map(|(s, _)| s), Some(3));
        // vLLM 0.32+: the topic frame before the sequence, and its four-frame end marker.
        let topical = [
            Bytes::new(),
            Bytes::from("kv@p@m"),
            seq_frame(4),
            Bytes::from("q"),
        ];
        let (seq, payload) = split_reply(&topical).flatten().unwrap();
        assert_eq!((seq, payload.as_ref()), (4, b"q".as_slice()));
        let end4 = [
            Bytes::new(),
            Bytes::new(),
            Bytes::copy_from_slice(&END_SEQ),
            Bytes::new(),
        ];
        assert_eq!(split_reply(&end4), Some(None));
        // Without the delimiter, both shapes still read.
        let stripped = [Bytes::from("kv@p@m"), seq_frame(5), Bytes::from("r")];
        assert_eq!(split_reply(&stripped).flatten().map(|(s, _)| s), Some(5));
        assert_eq!(split_reply(&reply[1..]).flatten().map(|(s, _)| s), Some(3));
        // Not a sequence where one must be, or a shape neither engine sends.
        let bad = [Bytes::new(), Bytes::from("x"), Bytes::from("p")];
        assert_eq!(split_reply(&bad), None);
        let bad4 = [
            Bytes::from("x"),
            Bytes::new(),
            seq_frame(3),
            Bytes::from("p"),
        ];
        assert_eq!(split_reply(&bad4), None);
        assert_eq!(split_reply(&[Bytes::new()]), None);
        let five = [
            Bytes::new(),
            Bytes::new(),
            Bytes::new(),
            seq_frame(1),
            Bytes::new(),
        ];
        assert_eq!(split_reply(&five), None);
    }
}
