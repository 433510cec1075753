//! The session book's tests: keyed and inferred sessions, moved reminders, bounds, and
//! property tests over real chat templates.

use super::*;

fn book(ttl_ms: u64, max_sessions: usize, min_blocks: u32) -> SessionBook {
    SessionBook::new(
        SessionLimits {
            ttl_ms,
            max_sessions,
        },
        min_blocks,
    )
}

fn prompt<'a>(key: Option<&'a str>, hashes: &'a [u64], full_blocks: usize) -> Prompt<'a> {
    Prompt {
        key,
        hashes,
        full_blocks,
        tokens: None,
        turns: None,
    }
}

/// Chained-looking hashes: a conversation `c`'s blocks after a shared system prefix of
/// `shared` blocks.
fn blocks(c: u64, shared: usize, n: usize) -> Vec<u64> {
    (0..n as u64)
        .map(|i| {
            if (i as usize) < shared {
                1_000 + i
            } else {
                c * 1_000_000 + i
            }
        })
        .collect()
}

#[test]
fn a_new_key_extending_a_one_turn_keyed_session_is_a_rotated_id() {
    let mut b = book(1_000, 10, 4);
    let h = blocks(1, 0, 9);
    let r1 = b.resolve(prompt(Some("id-1"), &h[..5], 5), 0, || unreachable!());
    assert_eq!(r1.unwrap().inferred, None);
    let r2 = b
        .resolve(prompt(Some("id-2"), &h[..7], 7), 1, || unreachable!())
        .unwrap();
    assert_eq!(
        (&*r2.key, r2.turn, r2.inferred),
        ("id-1", 2, Some(Inferred::Rotated))
    );
    // Found rotating, the session stays so for its next new id.
    let r3 = b
        .resolve(prompt(Some("id-3"), &h[..9], 9), 2, || unreachable!())
        .unwrap();
    assert_eq!((&*r3.key, r3.turn), ("id-1", 3));
    // A key already seen is trusted as it is; an inferred session is never a rotation.
    let r = b
        .resolve(prompt(Some("id-1"), &h[..9], 9), 3, || unreachable!())
        .unwrap();
    assert_eq!((r.turn, r.inferred), (4, None));
    let other = blocks(2, 0, 6);
    let inferred = b
        .resolve(prompt(None, &other[..5], 5), 4, || {
            "kvc-inferred-x".to_owned()
        })
        .unwrap();
    assert_eq!(inferred.inferred, Some(Inferred::New));
    let r = b
        .resolve(prompt(Some("id-9"), &other, 6), 5, || unreachable!())
        .unwrap();
    assert_eq!((&*r.key, r.inferred), ("id-9", None));
    // A second session starting with the very same prompt is a session of its own.
    let same = blocks(3, 0, 5);
    b.resolve(prompt(Some("twin-1"), &same, 5), 6, || unreachable!());
    let r = b
        .resolve(prompt(Some("twin-2"), &same, 5), 7, || unreachable!())
        .unwrap();
    assert_eq!((&*r.key, r.turn, r.inferred), ("twin-2", 1, None));
}

#[test]
fn keyed_turns_count_per_session_and_restart_after_the_ttl() {
    let mut b = book(100, 10, 4);
    let h = blocks(1, 0, 2);
    let turn = |b: &mut SessionBook, key, now| {
        b.resolve(prompt(Some(key), &h, 2), now, || unreachable!())
            .unwrap()
            .turn
    };
    assert_eq!(turn(&mut b, "a", 0), 1);
    assert_eq!(turn(&mut b, "a", 50), 2);
    assert_eq!(turn(&mut b, "b", 50), 1);
    assert_eq!(turn(&mut b, "a", 150), 3);
    assert_eq!(turn(&mut b, "a", 251), 1, "expired: a new session");
    let r = b
        .resolve(prompt(Some("a"), &h, 2), 252, String::new)
        .unwrap();
    assert_eq!(r.session, SessionId::from_key("a"));
    assert_eq!(&*r.key, "a");
    assert_eq!(r.inferred, None);
}

#[test]
fn the_book_is_bounded_by_the_session_limit() {
    let mut b = book(1_000_000, 2, 1);
    let keys = ["k0", "k1", "k2"];
    for (i, k) in keys.iter().enumerate() {
        let h = blocks(i as u64 + 1, 0, 3);
        for t in 0..2 {
            b.resolve(prompt(Some(k), &h, 3), i as u64 * 10 + t, String::new);
        }
    }
    assert_eq!(b.len(), 2);
    assert_eq!(
        b.anchor_count(),
        2,
        "the forgotten session's anchor went too"
    );
    // The least recently seen session was forgotten; the others kept their count.
    let h = blocks(9, 0, 3);
    assert_eq!(
        b.resolve(prompt(Some("k0"), &h, 3), 100, String::new)
            .unwrap()
            .turn,
        1
    );
    assert_eq!(
        b.resolve(prompt(Some("k2"), &h, 3), 101, String::new)
            .unwrap()
            .turn,
        3
    );
    assert_eq!(b.len(), 2);
}

#[test]
fn a_keyless_request_continues_the_session_it_extends() {
    let mut b = book(1_000_000, 100, 4);
    // Too short to infer anything: no session.
    let short = blocks(1, 0, 3);
    assert_eq!(b.resolve(prompt(None, &short, 3), 0, || "x".into()), None);
    assert_eq!(b.len(), 0);

    let a1 = blocks(1, 2, 6);
    let r = b
        .resolve(prompt(None, &a1, 5), 1, || "inferred-a".into())
        .unwrap();
    assert_eq!((r.turn, r.inferred), (1, Some(Inferred::New)));
    assert_eq!(&*r.key, "inferred-a");
    let sa = r.session;
    // Another conversation sharing only the 2-block system prefix: a new session.
    let b1 = blocks(2, 2, 6);
    let r = b
        .resolve(prompt(None, &b1, 6), 2, || "inferred-b".into())
        .unwrap();
    assert_eq!(r.inferred, Some(Inferred::New));
    let sb = r.session;
    assert_ne!(sa, sb);
    // Turn 2 of each extends its own first prompt (through its last full block).
    let a2 = blocks(1, 2, 9);
    let r = b
        .resolve(prompt(None, &a2, 8), 3, || unreachable!())
        .unwrap();
    assert_eq!(
        (r.session, r.turn, r.inferred),
        (sa, 2, Some(Inferred::Continued))
    );
    assert_eq!(&*r.key, "inferred-a");
    let b2 = blocks(2, 2, 7);
    let r = b
        .resolve(prompt(None, &b2, 7), 4, || unreachable!())
        .unwrap();
    assert_eq!((r.session, r.turn), (sb, 2));
    // A's anchor moved to its turn-2 prompt: a request that only extends turn 1 (and not
    // turn 2) is a new session.
    let fork = blocks(1, 2, 5);
    let r = b
        .resolve(prompt(None, &fork, 5), 5, || "fork".into())
        .unwrap();
    assert_eq!(r.inferred, Some(Inferred::New));
    assert_eq!(b.anchor_count(), 3);
}

#[test]
fn the_deepest_match_wins_then_the_most_recent() {
    let mut b = book(1_000_000, 100, 2);
    let shallow = blocks(1, 0, 3);
    let deep = blocks(1, 0, 5);
    // (Two turns under its key: a longer prompt under another key is no rotated id.)
    b.resolve(prompt(Some("shallow"), &shallow, 3), 9, String::new);
    let s_shallow = b
        .resolve(prompt(Some("shallow"), &shallow, 3), 10, String::new)
        .unwrap()
        .session;
    let s_deep = b
        .resolve(prompt(Some("deep"), &deep, 5), 5, String::new)
        .unwrap()
        .session;
    let longer = blocks(1, 0, 7);
    let r = b
        .resolve(prompt(None, &longer, 7), 20, String::new)
        .unwrap();
    assert_eq!(r.session, s_deep, "deepest, although less recent");
    assert_ne!(r.session, s_shallow);
    // Two sessions anchored at the same block: the most recent one.
    let mut b = book(1_000_000, 100, 2);
    let h = blocks(1, 0, 4);
    b.resolve(prompt(Some("old"), &h, 4), 1, String::new);
    b.resolve(prompt(Some("new"), &h, 4), 2, String::new);
    let r = b.resolve(prompt(None, &blocks(1, 0, 6), 6), 3, String::new);
    assert_eq!(r.unwrap().session, SessionId::from_key("new"));
    // An expired session is not continued.
    let mut b = book(10, 100, 2);
    b.resolve(prompt(Some("gone"), &h, 4), 0, String::new);
    let r = b
        .resolve(prompt(None, &blocks(1, 0, 6), 6), 11, || "fresh".into())
        .unwrap();
    assert_eq!(r.inferred, Some(Inferred::New));
    assert_eq!(&*r.key, "fresh");
}

/// Resolves a keyless chat (as the router hashes it, each word a token) in blocks of 4
/// tokens.
fn keyless(b: &mut SessionBook, messages: &[(&str, String)], now: u64) -> Resolved {
    let c = kvc_core::text::chat_tokens(
        messages.iter().map(|(r, t)| (*r, t.as_str())),
        kvc_core::text::fallback_tokens,
    );
    let turns = Turns {
        starts: &c.starts,
        newest_user: messages.iter().rposition(|(r, _)| *r == "user"),
    };
    let tokens = c.hashed();
    let hashes = kvc_core::text::block_hashes(tokens, kvc_core::BlockSize::new(4).unwrap());
    b.resolve(
        Prompt {
            key: None,
            hashes: &hashes,
            full_blocks: tokens.len() / 4,
            tokens: Some((tokens, 4)),
            turns: Some(turns),
        },
        now,
        || format!("inferred-{now}"),
    )
    .unwrap()
}

fn text(words: &str) -> String {
    words.to_owned()
}

/// Qwen Code's shape: the current date before the newest user message's text, left out
/// of the history sent with the next request. Aider's: its edit-format rules after it.
/// Each conversation's next turns continue it (the reminder moved to the new last
/// message); a second conversation with the same system prompt and reminder starts a
/// session of its own and stays apart.
#[test]
fn a_reminder_moved_to_the_newest_message_continues_the_session() {
    let system = text("you are a coding agent with tools to read and edit files");
    let date = "<reminder> the current date is monday december 7 </reminder> ";
    let rules = " to suggest changes you must return the whole file in a fenced block";
    for shape in ["before", "after"] {
        let reminder = if shape == "before" { date } else { rules };
        let with = |r: &str, t: &str| {
            if shape == "before" {
                format!("{r}{t}")
            } else {
                format!("{t}{r}")
            }
        };
        let mut b = book(1_000_000, 100, 1);
        let turn = |task: &str, n: usize| -> Vec<(&str, String)> {
            let mut m = vec![("system", system.clone())];
            for i in 0..n {
                m.push(("user", format!("{task} step {i} please")));
                m.push(("assistant", format!("done {task} {i}")));
            }
            m.push(("user", with(reminder, &format!("{task} step {n} please"))));
            m
        };
        let a1 = keyless(&mut b, &turn("read lib.rs", 0), 1);
        assert_eq!(a1.inferred, Some(Inferred::New), "{shape}");
        let other1 = keyless(&mut b, &turn("fix the failing test", 0), 2);
        assert_eq!(other1.inferred, Some(Inferred::New), "{shape}: apart");
        assert_ne!(other1.session, a1.session);
        for n in 1..4 {
            let a = keyless(&mut b, &turn("read lib.rs", n), 10 * n as u64);
            assert_eq!(
                (a.session, a.inferred, a.turn),
                (a1.session, Some(Inferred::Continued), n as u32 + 1),
                "{shape}: turn {}",
                n + 1
            );
            let o = keyless(&mut b, &turn("fix the failing test", n), 10 * n as u64 + 1);
            assert_eq!(
                (o.session, o.inferred),
                (other1.session, Some(Inferred::Continued)),
                "{shape}: the other, turn {}",
                n + 1
            );
        }
    }
}

/// Within a turn of tool calls the newest user message keeps its reminder (the prompt
/// extends the last whole); the next user turn drops it from that message, now behind
/// tool results, and adds it to the new one.
#[test]
fn a_reminder_moved_past_tool_results_continues_the_session() {
    let mut b = book(1_000_000, 100, 1);
    let system = (
        "system",
        text("you are a coding agent with tools to read and edit files"),
    );
    let date = "<reminder> the current date is monday december 7 </reminder> ";
    let first = keyless(
        &mut b,
        &[
            system.clone(),
            ("user", format!("{date}read lib.rs please")),
        ],
        1,
    );
    let tool = keyless(
        &mut b,
        &[
            system.clone(),
            ("user", format!("{date}read lib.rs please")),
            ("assistant", text("[read_file(path='lib.rs')]")),
            ("tool", text("pub fn add(a: u32, b: u32) -> u32 { a + b }")),
        ],
        2,
    );
    assert_eq!(
        (tool.session, tool.inferred),
        (first.session, Some(Inferred::Continued))
    );
    let next = keyless(
        &mut b,
        &[
            system.clone(),
            ("user", text("read lib.rs please")),
            ("assistant", text("[read_file(path='lib.rs')]")),
            ("tool", text("pub fn add(a: u32, b: u32) -> u32 { a + b }")),
            ("assistant", text("add returns the sum")),
            ("user", format!("{date}now add a test")),
        ],
        3,
    );
    assert_eq!(
        (next.session, next.inferred, next.turn),
        (first.session, Some(Inferred::Continued), 3)
    );
    // Its words left out and not found in the last message: not the same conversation.
    let edited = keyless(
        &mut b,
        &[
            system,
            ("user", text("read lib.rs please")),
            ("assistant", text("[read_file(path='lib.rs')]")),
            ("tool", text("pub fn add(a: u32, b: u32) -> u32 { a + b }")),
            ("assistant", text("add returns the sum")),
            ("user", text("now add a test")),
            ("assistant", text("added")),
            ("user", text("run it")),
        ],
        4,
    );
    assert_eq!(edited.inferred, Some(Inferred::New));
}

/// The records a moved reminder is matched by are bounded all together: past the budget,
/// the least recently seen sessions' go, and their next turn (which extends no whole
/// prompt) starts a session of its own; the others still continue theirs.
#[test]
fn moved_reminder_records_are_bounded_by_their_budget() {
    let mut b = book(1_000_000, 100, 1);
    let system = (
        "system",
        text("you are a coding agent with tools to read and edit files"),
    );
    let date = "<reminder> the current date is monday december 7 </reminder> ";
    let first = |task: &str| vec![system.clone(), ("user", format!("{date}{task} please"))];
    let next = |task: &str| {
        vec![
            system.clone(),
            ("user", format!("{task} please")),
            ("assistant", text("done")),
            ("user", format!("{date}and then test it")),
        ]
    };
    let one = keyless(&mut b, &first("read lib.rs"), 1);
    let per_session = b.moved_tokens;
    assert!(per_session > 10, "{per_session}");
    // Room for three sessions' records: the fourth sheds the oldest (down to 3/4).
    b.moved_budget = per_session * 3 + per_session / 2;
    keyless(&mut b, &first("fix main.rs"), 2);
    let three = keyless(&mut b, &first("explain util.rs"), 3);
    let four = keyless(&mut b, &first("rename a function"), 4);
    assert!(
        b.moved_tokens <= b.moved_budget,
        "{} tokens",
        b.moved_tokens
    );
    let lost = keyless(&mut b, &next("read lib.rs"), 5);
    assert_eq!(lost.inferred, Some(Inferred::New));
    assert_ne!(lost.session, one.session);
    for (task, s, now) in [
        ("explain util.rs", &three, 6),
        ("rename a function", &four, 7),
    ] {
        let r = keyless(&mut b, &next(task), now);
        assert_eq!(
            (r.session, r.inferred),
            (s.session, Some(Inferred::Continued)),
            "{task}"
        );
    }
}

#[test]
fn inference_off_routes_keyless_requests_without_a_session() {
    let mut b = book(1_000_000, 100, 0);
    let h = blocks(1, 0, 8);
    b.resolve(prompt(Some("k"), &h, 8), 0, String::new);
    assert_eq!(b.anchor_count(), 0);
    assert_eq!(b.resolve(prompt(None, &h, 8), 1, || "x".into()), None);
}

/// Conversations as clients send them: their messages rendered by the router (a chat
/// request, [`kvc_core::text::chat_tokens`]) or by a real model's chat template into a
/// text prompt (ChatML as Qwen's, Llama 3's, the real-vLLM harness's), tokenized, in
/// blocks of any size.
mod properties {
    use super::*;
    use kvc_core::BlockSize;
    use kvc_core::text::{block_hashes, chat_tokens, fallback_tokens};
    use proptest::prelude::*;

    #[derive(Debug, Clone, Copy)]
    enum Render {
        /// A chat request: the router hashes its messages, not the generation prompt.
        Router,
        ChatMl,
        Llama3,
        Harness,
    }

    /// The tokens a request's block hashes cover, and for a chat request where its
    /// messages start and which is its newest user message.
    #[allow(clippy::type_complexity)]
    fn hashed(
        render: Render,
        messages: &[(String, String)],
    ) -> (Vec<u32>, Option<(Vec<usize>, Option<usize>)>) {
        let (open, close, generation): (fn(&str) -> String, &str, &str) = match render {
            Render::Router => {
                let pairs = messages.iter().map(|(r, c)| (r.as_str(), c.as_str()));
                let c = chat_tokens(pairs, fallback_tokens);
                let newest_user = messages.iter().rposition(|(r, _)| r == "user");
                return (c.hashed().to_vec(), Some((c.starts, newest_user)));
            }
            Render::ChatMl => (
                |r| format!("<|im_start|>{r}\n"),
                "<|im_end|>\n",
                "<|im_start|>assistant\n",
            ),
            Render::Llama3 => (
                |r| format!("<|start_header_id|>{r}<|end_header_id|>\n\n"),
                "<|eot_id|>",
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
            ),
            Render::Harness => (|r| format!("<|{r}|>\n"), "<|end|>\n", "<|assistant|>\n"),
        };
        let mut text = String::new();
        if matches!(render, Render::Llama3) {
            text.push_str("<|begin_of_text|>");
        }
        for (role, content) in messages {
            text.push_str(&open(role));
            text.push_str(content);
            text.push_str(close);
        }
        text.push_str(generation);
        (fallback_tokens(&text), None)
    }

    /// A chat request's messages: the conversation's, with `reminder` added to its newest
    /// user message (0: none; 1: before its text, as Qwen Code adds the date; 2: after
    /// it, as Aider adds its edit format's rules), which the conversation itself keeps
    /// without it.
    fn sent(conv: &[(String, String)], reminder: u8, words_of: &str) -> Vec<(String, String)> {
        let mut m = conv.to_vec();
        if let Some(u) = m.iter_mut().rev().find(|(r, _)| r == "user") {
            match reminder {
                1 => u.1 = format!("{words_of}{}", u.1),
                2 => u.1 = format!("{}{words_of}", u.1),
                _ => {}
            }
        }
        m
    }

    fn words(tag: &str, n: usize) -> String {
        (0..n).map(|i| format!("{tag}{i} ")).collect::<String>()
    }

    /// What a turn appends: 0 a user message after a user message (a retry after a
    /// cut-off answer), 1 an answer and a user message, 2 an answer with a tool call and
    /// the tool's result, 3 two tool results.
    fn append(conv: &mut Vec<(String, String)>, render: Render, step: u8, n: usize, tag: &str) {
        let msg = |role: &str, t: &str| (role.to_owned(), words(&format!("{tag}{t}"), n));
        // A text prompt ends with the generation prompt: the next one extends it only
        // with the answer it asked for (a chat request's messages extend with anything).
        let step = match render {
            Render::Router => step % 4,
            _ => 1 + step % 2,
        };
        match step {
            0 => conv.push(msg("user", "again")),
            1 => conv.extend([msg("assistant", "answer"), msg("user", "next")]),
            2 => conv.extend([msg("assistant", "call"), msg("tool", "result")]),
            _ => conv.extend([msg("tool", "out"), msg("tool", "more")]),
        }
    }

    fn render_strategy() -> impl Strategy<Value = Render> {
        prop_oneof![
            Just(Render::Router),
            Just(Render::ChatMl),
            Just(Render::Llama3),
            Just(Render::Harness)
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Every turn of a conversation that sends no session key continues its session,
        /// whatever the block size and the lengths (its first request too, unless it is
        /// shorter than one full block); another conversation with the same system prompt
        /// and a first message of its own, interleaved with it, is never glued to it. So
        /// too for chat requests whose newest user message carries a reminder the history
        /// leaves out, before or after its text, where a system prompt precedes it.
        #[test]
        fn keyless_conversations_hold_and_stay_apart(
            render in render_strategy(),
            block in 1u32..64,
            system in 0usize..200,
            first in 1usize..40,
            steps in proptest::collection::vec((any::<u8>(), 1usize..60), 1..8),
            reminder in 0u8..3,
            reminder_words in 3usize..30,
        ) {
            let reminder = if matches!(render, Render::Router) { reminder } else { 0 };
            // Something comes before the newest user message (a system prompt).
            prop_assume!(reminder == 0 || system > 0);
            let reminded = words("remind", reminder_words);
            let bs = BlockSize::new(block).unwrap();
            let mut book = book(1_000_000, 1_000, 1);
            let shared = words("system", system);
            let mut convs: Vec<Vec<(String, String)>> = ["a", "b"]
                .iter()
                .map(|tag| {
                    let mut c = Vec::new();
                    if system > 0 {
                        c.push(("system".to_owned(), shared.clone()));
                    }
                    c.push(("user".to_owned(), words(&format!("task-{tag}-"), first)));
                    c
                })
                .collect();
            let mut sessions: [Option<SessionId>; 2] = [None, None];
            let mut now = 0;
            for turn in 0..=steps.len() {
                for (k, tag) in ["a", "b"].into_iter().enumerate() {
                    if turn > 0 {
                        let (step, n) = steps[turn - 1];
                        append(&mut convs[k], render, step, n, tag);
                    }
                    let (tokens, turns) =
                        hashed(render, &sent(&convs[k], reminder, &reminded));
                    let turns = turns.as_ref().map(|(starts, newest_user)| Turns {
                        starts,
                        newest_user: *newest_user,
                    });
                    let hashes = block_hashes(&tokens, bs);
                    let full_blocks = tokens.len() / block as usize;
                    now += 1;
                    let r = book.resolve(
                        Prompt {
                            key: None,
                            hashes: &hashes,
                            full_blocks,
                            tokens: Some((&tokens, block as usize)),
                            turns,
                        },
                        now,
                        || format!("inferred-{tag}-{turn}"),
                    );
                    let Some(r) = r else {
                        prop_assert_eq!(full_blocks, 0, "{:?} turn {} placed nowhere", render, turn);
                        continue;
                    };
                    match sessions[k] {
                        None => {
                            prop_assert_eq!(r.inferred, Some(Inferred::New));
                            sessions[k] = Some(r.session);
                        }
                        Some(s) => {
                            prop_assert_eq!(
                                (r.session, r.inferred),
                                (s, Some(Inferred::Continued)),
                                "{:?} conversation {} turn {}", render, tag, turn
                            );
                        }
                    }
                }
                if let [Some(a), Some(b)] = sessions {
                    prop_assert_ne!(a, b, "{:?}: glued at turn {}", render, turn);
                }
            }
        }
    }
}
