//! A decode worker drained during a run (`SimConfig::drains`, `kvc-replay sim --drain`): no turn
//! is placed on it afterwards, and with `kvc`'s `migrate-with-kv` the sessions it held move
//! with their KV instead of being prefilled again.

mod common;

use kvc_core::{BlockSize, ExecutionMode, Topology, WorkerId};
use kvc_policy::{KvcConfig, PolicyConfig};
use kvc_replay::sim::config::Drain;
use kvc_replay::sim::{Profile, SimConfig, SimOutput, simulate};
use kvc_replay::trace::{Trace, generate::SweConfig};

/// Agentic SWE sessions packed closer than the reference rate (64 started within 1,000 s),
/// so that a worker holds several when it is drained.
fn trace() -> Trace {
    let (subagents, compactions, ends) = SweConfig::AGENTIC;
    common::trace_of(&SweConfig {
        seed: 1,
        sessions: 64,
        start_span_s: Some(1_000.0),
        subagents,
        compactions,
        ends,
        ..SweConfig::default()
    })
}

const DRAIN_AT_S: f64 = 300.0;

/// 2p4d with room on every worker (eight times the reference pool: no eviction pressure, so
/// that the runs differ by the drained sessions, not by what every later placement evicts),
/// `d0` (worker 2) drained at 300 s.
fn run(trace: &Trace, migrate_with_kv: bool) -> SimOutput {
    let topology: Topology = "2p4d".parse().unwrap();
    let policy = PolicyConfig::Kvc(KvcConfig {
        migrate_with_kv,
        ..KvcConfig::default()
    });
    let mut cfg = SimConfig::new(topology, policy);
    let mut profile = Profile::default();
    profile.hardware.kv_pool_tokens *= 8;
    cfg.profile = profile;
    cfg.drains.push(Drain {
        worker: WorkerId(2),
        at_s: DRAIN_AT_S,
    });
    simulate(trace, &cfg, &mut |_, _| {}).unwrap()
}

#[test]
fn a_drained_worker_gets_no_turn_and_its_sessions_move_with_their_kv() {
    let trace = trace();
    assert_eq!(trace.block_size(), BlockSize::default());
    let reseed = run(&trace, false);
    let with_kv = run(&trace, true);
    for (name, out) in [("re-seeding", &reseed), ("migrate-with-kv", &with_kv)] {
        let after: Vec<_> = out
            .records
            .iter()
            .filter(|r| r.dispatch_s >= DRAIN_AT_S)
            .collect();
        assert!(after.len() > 1_000, "{name}: {} turns after", after.len());
        for r in &after {
            assert_ne!(r.decode.as_deref(), Some("d0"), "{name}: turn {}", r.index);
            // The drained worker prefills nothing but its own sessions' moves.
            if r.prefill.as_deref() == Some("d0") {
                assert_eq!(
                    r.mode,
                    Some(ExecutionMode::MigrateKv),
                    "{name}: {}",
                    r.index
                );
            }
        }
        let d = &out.summary.drains[0];
        assert_eq!((d.worker.as_str(), d.at_s), ("d0", DRAIN_AT_S), "{name}");
        assert!(d.sessions >= 4 && d.returned >= 3, "{name}: {d:?}");
        assert!(d.returned <= d.sessions && d.returned_tokens <= d.resident_tokens);
        assert_eq!(
            d.next_turn_modes.values().sum::<usize>(),
            d.returned,
            "{name}"
        );
        assert_eq!(out.summary.mechanism_errors, 0, "{name}");
    }
    let (r, k) = (&reseed.summary.drains[0], &with_kv.summary.drains[0]);
    // The same sessions were held and came back (the runs are the same up to the drain).
    assert_eq!(
        (r.sessions, r.resident_tokens, r.returned, r.returned_tokens),
        (k.sessions, k.resident_tokens, k.returned, k.returned_tokens)
    );
    // Re-seeding, each returning session is prefilled again on its new worker or a prefill
    // worker; with its KV, every one moves from the drained worker.
    assert!(!r.next_turn_modes.contains_key("migrate-kv"), "{r:?}");
    assert_eq!(
        k.next_turn_modes.get("migrate-kv"),
        Some(&k.returned),
        "{k:?}"
    );
    // A moved turn finds cached on the worker it leaves all it shares with the previous
    // prompt (the agent elides old tool output, so not always the whole of it), and computes
    // only the rest; a re-seed computes what it finds nowhere cached (all but the shared
    // system prompt, here).
    let block = u64::from(BlockSize::default().tokens());
    let requests: Vec<_> = trace.iter().collect();
    let mut moved = 0;
    for m in with_kv
        .records
        .iter()
        .filter(|m| m.dispatch_s >= DRAIN_AT_S && m.mode == Some(ExecutionMode::MigrateKv))
    {
        let now = requests[m.index];
        let prev = requests[..m.index]
            .iter()
            .rfind(|p| p.session == now.session)
            .expect("a moved session's earlier turn");
        let shared = now
            .hash_ids
            .iter()
            .zip(prev.hash_ids.iter())
            .take_while(|(a, b)| a == b)
            .count() as u64;
        assert!(
            m.cached_tokens >= (shared * block).min(now.input_length),
            "turn {}: {} cached of {shared} blocks shared with the previous prompt",
            m.index,
            m.cached_tokens,
        );
        moved += 1;
    }
    assert_eq!(moved, k.returned);
    // The system prompt (1,800 tokens: three whole blocks) per re-seeded turn.
    let system = SweConfig::default().system_prompt_tokens / block * block;
    assert_eq!(
        r.next_turn_tokens.cached,
        r.returned as u64 * system,
        "{r:?}"
    );
    let saved = r.next_turn_tokens.computed - k.next_turn_tokens.computed;
    assert_eq!(
        saved,
        k.next_turn_tokens.cached - r.next_turn_tokens.cached,
        "the same prompts"
    );
    assert!(saved > 100_000, "{saved}");
    // The moved turns start sooner: their sender computes the new tokens only.
    assert!(
        k.next_turn_ttft_mean_s < r.next_turn_ttft_mean_s * 0.75,
        "{k:?} vs {r:?}"
    );
    // The whole run prefills less by what the moved turns saved (with room everywhere, the
    // rest of the run is nearly the same), its mean TTFT is lower and its p90 the same within
    // the shifts of every later turn's timing (0.4% here).
    let (rs, ks) = (&reseed.summary, &with_kv.summary);
    let run_saved = rs
        .prompt_tokens
        .computed
        .saturating_sub(ks.prompt_tokens.computed);
    assert!(
        run_saved >= saved - saved / 10,
        "run: {:?} vs {:?}, the moved turns saved {saved}",
        ks.prompt_tokens,
        rs.prompt_tokens
    );
    assert!(
        ks.ttft_s.mean < rs.ttft_s.mean,
        "{:?} vs {:?}",
        ks.ttft_s,
        rs.ttft_s
    );
    assert!(
        ks.ttft_s.p90 <= rs.ttft_s.p90 * 1.01,
        "{:?} vs {:?}",
        ks.ttft_s,
        rs.ttft_s
    );
}

#[test]
fn drains_a_run_cannot_do_are_refused_before_it_starts() {
    let trace = trace();
    let cfg = |drains: Vec<Drain>| {
        let mut c = SimConfig::new("1p2d".parse().unwrap(), PolicyConfig::default());
        c.drains = drains;
        c
    };
    let at = |w: u32, at_s: f64| Drain {
        worker: WorkerId(w),
        at_s,
    };
    for (drains, expected) in [
        (vec![at(0, 10.0)], "p0 is a prefill worker"),
        (vec![at(3, 10.0)], "has no worker 3"),
        (vec![at(1, f64::NAN)], "must be a number of seconds"),
        (vec![at(1, -1.0)], "must be a number of seconds"),
        (vec![at(1, 10.0), at(1, 20.0)], "d0 is drained twice"),
        (
            vec![at(1, 10.0), at(2, 20.0)],
            "every worker that hosts sessions is drained",
        ),
    ] {
        let err = simulate(&trace, &cfg(drains.clone()), &mut |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains(expected), "{drains:?}: {err}");
    }
}
