//! The SWE generator's coding-agent options (subagents, compactions, explicit ends): what they
//! add, that they are deterministic, and that without them the trace is byte for byte the one
//! the generator gave before they existed.

use kvc_core::prefix::shared_prefix_blocks;
use kvc_core::{BlockSize, DEFAULT_MAX_INPUT_TOKENS, SessionId, TraceRecord};
use kvc_replay::trace::generate::{COMPACTION_THRESHOLD, SweConfig, swe, swe_stream};
use kvc_replay::trace::{self, LoadOptions, Trace, stats};
use std::collections::BTreeMap;

/// SHA-256 (FIPS 180-4) of `data`, as lowercase hex: the figure `sha256sum` prints.
fn sha256(data: &[u8]) -> String {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&(data.len() as u64 * 8).to_be_bytes());
    for chunk in msg.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, word) in chunk.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let mut v = h;
        for i in 0..64 {
            let s1 = v[4].rotate_right(6) ^ v[4].rotate_right(11) ^ v[4].rotate_right(25);
            let ch = (v[4] & v[5]) ^ (!v[4] & v[6]);
            let t1 = v[7]
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = v[0].rotate_right(2) ^ v[0].rotate_right(13) ^ v[0].rotate_right(22);
            let maj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
            let t2 = s0.wrapping_add(maj);
            v = [
                t1.wrapping_add(t2),
                v[0],
                v[1],
                v[2],
                v[3].wrapping_add(t1),
                v[4],
                v[5],
                v[6],
            ];
        }
        for (x, y) in h.iter_mut().zip(v) {
            *x = x.wrapping_add(y);
        }
    }
    h.iter().map(|x| format!("{x:08x}")).collect()
}

fn jsonl(records: &[TraceRecord]) -> Vec<u8> {
    let mut out = Vec::new();
    trace::write_jsonl(&mut out, records).unwrap();
    out
}

fn agentic(seed: u64) -> SweConfig {
    let (subagents, compactions, ends) = SweConfig::AGENTIC;
    SweConfig {
        seed,
        subagents,
        compactions,
        ends,
        ..SweConfig::default()
    }
}

fn within(name: &str, value: f64, lo: f64, hi: f64) {
    assert!(
        (lo..=hi).contains(&value),
        "{name} = {value}, outside {lo}..={hi}"
    );
}

#[test]
fn sha256_is_the_standard_one() {
    assert_eq!(
        sha256(b""),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    assert_eq!(
        sha256(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
}

/// The figures `kvc-replay gen swe … | sha256sum` gave before the coding-agent options
/// existed; with the options off (their default) the generator must still give these bytes.
#[test]
fn default_options_give_the_bytes_of_the_generator_before_the_agent_options() {
    let cases: [(SweConfig, &str, usize); 5] = [
        (
            SweConfig {
                seed: 1,
                ..SweConfig::default()
            },
            "ce99443c6d6cdac332834b87d915f92da03674b489da9355f777e8c81a681ac8",
            1_899_569,
        ),
        (
            SweConfig {
                seed: 7,
                ..SweConfig::default()
            },
            "c9696c20724398b75e96f64562192373776d20225fbb36afeaf5149e396b3a15",
            1_848_235,
        ),
        (
            SweConfig {
                seed: 11,
                ..SweConfig::default()
            },
            "a098c673d878822c2e046b7c08ce70b1cd9fdbbf2f3b65fc9b54e2008aaf2f9a",
            1_885_382,
        ),
        (
            SweConfig {
                seed: 3,
                sessions: 10,
                requests: Some(600),
                ..SweConfig::default()
            },
            "6df64bbaf17483993007f0c3f6e8bf00a1c19fa51d8dd846410e75f951108546",
            191_261,
        ),
        (
            SweConfig {
                seed: 5,
                sessions: 16,
                start_span_s: Some(600.0),
                ..SweConfig::default()
            },
            "1377b407eaf6015e15d08c27c3b5d5bfa8eb73dd47cbfbac75eef58b76187e7b",
            534_073,
        ),
    ];
    for (cfg, digest, bytes) in cases {
        let out = jsonl(&swe(&cfg));
        assert_eq!(out.len(), bytes, "{cfg:?}");
        assert_eq!(sha256(&out), digest, "{cfg:?}");
    }
}

/// Records of each session, in trace order.
fn by_session(records: &[TraceRecord]) -> BTreeMap<SessionId, Vec<&TraceRecord>> {
    let mut m: BTreeMap<SessionId, Vec<&TraceRecord>> = BTreeMap::new();
    for r in records {
        m.entry(r.session_id.unwrap()).or_default().push(r);
    }
    m
}

#[test]
fn agentic_preset_adds_children_compactions_and_ends() {
    let cfg = agentic(1);
    let records = swe(&cfg);
    let bs = BlockSize::default();
    // Deterministic: the same bytes on a second run; the stream plans what it gives.
    assert_eq!(jsonl(&swe(&cfg)), jsonl(&records));
    let stream = swe_stream(&cfg);
    assert_eq!(stream.planned_total(), records.len());
    let children_planned = stream.planned_subagents();

    // Well formed: sorted by (timestamp, session, turn), turns 1..n per session, lengths.
    assert!(records.windows(2).all(|w| {
        let key = |r: &TraceRecord| (r.timestamp, r.session_id, r.turn_id);
        key(&w[0]) < key(&w[1])
    }));
    assert!(records.iter().all(|r| r.hash_len_matches(bs)));
    let sessions = by_session(&records);
    for reqs in sessions.values() {
        for (k, r) in reqs.iter().enumerate() {
            assert_eq!(r.turn_id.unwrap().0 as usize, k + 1);
        }
    }

    // Subagents: round(0.3 · 52) = 16 parents, 1–3 children each, ids 52 and up.
    let children: Vec<(&SessionId, &Vec<&TraceRecord>)> = sessions
        .iter()
        .filter(|(_, reqs)| reqs[0].parent_session_id.is_some())
        .collect();
    assert_eq!(children.len(), children_planned);
    let mut parents: Vec<SessionId> = children
        .iter()
        .map(|(_, reqs)| reqs[0].parent_session_id.unwrap())
        .collect();
    parents.dedup();
    assert_eq!(parents.len(), 16);
    within("children", children.len() as f64, 16.0, 48.0);
    assert_eq!(sessions.len(), 52 + children.len());
    let system = 3; // blocks of the 1,800-token system prompt
    for (id, reqs) in &children {
        assert!(id.0 >= 52, "child id {id}");
        let parent_id = reqs[0].parent_session_id.unwrap();
        assert!(parent_id.0 < 52);
        assert!(reqs.iter().all(|r| r.parent_session_id == Some(parent_id)));
        assert!((2..=6).contains(&reqs.len()), "{} turns", reqs.len());
        // The parent is live: a turn before the child's first request, one after its last.
        let parent = &sessions[&parent_id];
        let (first, last) = (reqs[0], reqs[reqs.len() - 1]);
        let before = parent
            .iter()
            .rev()
            .find(|p| p.timestamp < first.timestamp)
            .expect("parent turn before the child");
        assert!(parent.iter().any(|p| p.timestamp > last.timestamp));
        // The first prompt: the parent's system prompt blocks, then a task of its own of a few
        // thousand uncached tokens.
        assert_eq!(first.hash_ids[..system], parent[0].hash_ids[..system]);
        assert_eq!(
            shared_prefix_blocks(&first.hash_ids, &before.hash_ids),
            system
        );
        let uncached = first.input_length - system as u64 * 512;
        assert!((1_000..8_192).contains(&uncached), "uncached {uncached}");
        // It grows turn by turn (a retry or an elision aside).
        assert!(last.input_length > first.input_length);
    }

    // Compactions: the prompt falls to the system prompt, a summary and the newest message.
    let mut compactions = 0;
    for reqs in sessions.values() {
        for w in reqs.windows(2) {
            let (a, b) = (w[0], w[1]);
            let kept = shared_prefix_blocks(&a.hash_ids, &b.hash_ids);
            if kept <= system && a.input_length > 20_000 {
                compactions += 1;
                assert_eq!(kept, system);
                assert!(a.input_length <= COMPACTION_THRESHOLD);
                within("compacted input", b.input_length as f64, 3_500.0, 21_000.0);
            }
        }
    }
    within("compactions", compactions as f64, 8.0, 30.0);

    // Ends: round(0.8 · 52) = 42 top-level sessions; children with probability 0.8.
    let ended = |ids: &mut dyn Iterator<Item = &Vec<&TraceRecord>>| {
        ids.filter(|reqs| reqs[reqs.len() - 1].session_final)
            .count()
    };
    let top: Vec<&Vec<&TraceRecord>> = sessions
        .iter()
        .filter(|(id, _)| id.0 < 52)
        .map(|(_, r)| r)
        .collect();
    assert_eq!(ended(&mut top.iter().copied()), 42);
    let child_ends = ended(&mut children.iter().map(|(_, r)| *r));
    within(
        "child ends",
        child_ends as f64 / children.len() as f64,
        0.5,
        1.0,
    );
    // `final` only ever on a session's last request.
    assert_eq!(
        records.iter().filter(|r| r.session_final).count(),
        42 + child_ends
    );

    // `stats` finds the same on the loaded trace.
    let (trace, _) = Trace::from_records(&records, &LoadOptions::default()).unwrap();
    let s = stats::compute(&trace, DEFAULT_MAX_INPUT_TOKENS);
    assert_eq!(s.subagents.explicit, children.len());
    assert_eq!(s.subagents.explicit_parents, 16);
    // Children share only the common system prompt with their parents: none is inferred.
    assert_eq!(s.subagents.common_blocks, system);
    assert_eq!(s.subagents.inferred, 0);
    assert_eq!(s.compactions.count, compactions);
    assert_eq!(s.ends.count, 42 + child_ends);
    assert_eq!(s.ends.final_not_last, 0);
    // The sessions that end past the limit are the same ones.
    within("over limit", s.over_limit as f64, 3.0, 8.0);
}

#[test]
fn each_option_leaves_the_rest_of_the_trace_alone() {
    let base = swe(&SweConfig {
        seed: 7,
        ..SweConfig::default()
    });
    // Ends only: the same records, some flagged final.
    let ends = swe(&SweConfig {
        seed: 7,
        ends: 0.5,
        ..SweConfig::default()
    });
    assert_eq!(ends.len(), base.len());
    let flagged = ends.iter().filter(|r| r.session_final).count();
    assert_eq!(flagged, 26);
    let unflagged: Vec<TraceRecord> = ends
        .into_iter()
        .map(|r| TraceRecord {
            session_final: false,
            ..r
        })
        .collect();
    assert_eq!(unflagged, base);

    // What a session looks like apart from its block ids' numbers (which count blocks in order
    // of first appearance in the whole trace): per turn, time, lengths and blocks kept.
    let shape = |reqs: &[&TraceRecord]| -> Vec<(u64, u64, u64, usize)> {
        let mut prev: &[kvc_core::BlockHash] = &[];
        reqs.iter()
            .map(|r| {
                let kept = shared_prefix_blocks(prev, &r.hash_ids);
                prev = &r.hash_ids;
                (r.timestamp, r.input_length, r.output_length, kept)
            })
            .collect()
    };

    // Compactions only: the same sessions and turns; sessions that do not compact unchanged,
    // the long ones (all of them, at 1.0) never above the threshold.
    let compacted = swe(&SweConfig {
        seed: 7,
        compactions: 1.0,
        ..SweConfig::default()
    });
    let (a, b) = (by_session(&base), by_session(&compacted));
    assert_eq!(a.len(), b.len());
    let mut long = 0;
    for (id, reqs) in &a {
        assert_eq!(reqs.len(), b[id].len());
        let peak = reqs.iter().map(|r| r.input_length).max().unwrap();
        let over_limit = peak > DEFAULT_MAX_INPUT_TOKENS;
        if peak > COMPACTION_THRESHOLD && !over_limit {
            long += 1;
            assert!(b[id].iter().all(|r| r.input_length <= COMPACTION_THRESHOLD));
        } else {
            assert_eq!(shape(reqs), shape(&b[id]), "session {id}");
        }
    }
    assert!(long > 10, "{long} long sessions");

    // Subagents only: the top-level sessions keep their prompts and turns; a parent's turns
    // after its children start later.
    let spawned = swe(&SweConfig {
        seed: 7,
        subagents: 1.0,
        ..SweConfig::default()
    });
    let c = by_session(&spawned);
    for (id, reqs) in &a {
        let (x, y) = (shape(reqs), shape(&c[id]));
        assert_eq!(x.len(), y.len());
        for (x, y) in x.iter().zip(&y) {
            assert_eq!((x.1, x.2, x.3), (y.1, y.2, y.3));
            assert!(y.0 >= x.0);
        }
    }
    within("children", (c.len() - a.len()) as f64, 52.0, 156.0);
}
