//! The worker model's behaviour, one case a test.

use super::worker::ResidentEntry;
use super::*;
use kvc_admission::EvictionConfig;
use kvc_core::{BlockHash, BlockSize, Capabilities, SessionId, WorkerId, WorkerRole};

/// Wakes `e` in time order until job `id` has its first token (the events before it are
/// dropped); `now` ends at that wake-up.
fn run_to_first_token(e: &mut Engine, id: usize, now: &mut Micros) {
    loop {
        let ev = e.take_events();
        if ev
            .iter()
            .any(|x| matches!(x, Event::FirstToken { id: i, .. } if *i == id))
        {
            return;
        }
        let mut wakes = e.take_wakes();
        wakes.sort_by_key(|(t, _)| *t);
        let (t, w) = wakes.remove(0);
        e.wakes.extend(wakes);
        *now = t;
        e.wake(w, *now);
    }
}

fn engine(roles: &[WorkerRole], pool: u64, timeout_s: f64) -> Engine {
    engine_with(roles, pool, |p| p.fit.transfer_timeout_s = timeout_s)
}

/// An idle-only-eviction engine with pool `pool` and the profile adjusted by `adjust`.
fn engine_with(roles: &[WorkerRole], pool: u64, adjust: impl FnOnce(&mut Profile)) -> Engine {
    let mut profile = Profile::default();
    profile.hardware.kv_pool_tokens = pool;
    profile.model.max_input_tokens = pool / 2;
    adjust(&mut profile);
    let eviction = EvictionConfig {
        allow_cold: false,
        allow_hot: false,
        ..EvictionConfig::default()
    };
    Engine::new(
        profile,
        EngineOptions {
            eviction,
            block_size: BlockSize::default(),
        },
        roles,
        1,
        0.0,
    )
}

fn job(id: usize, session: u64, blocks: &[u64], input: u64, output: u64) -> Job {
    Job {
        id,
        session: SessionId(session),
        input,
        output,
        hashes: blocks
            .iter()
            .copied()
            .map(BlockHash)
            .collect::<Vec<_>>()
            .into(),
    }
}

/// Runs the engine until it has nothing scheduled; returns the events.
fn settle(e: &mut Engine, now: &mut Micros) -> Vec<Event> {
    let mut events = e.take_events();
    let mut wakes = e.take_wakes();
    while !wakes.is_empty() {
        wakes.sort_by_key(|(t, _)| *t);
        let (t, w) = wakes.remove(0);
        *now = (*now).max(t);
        e.wake(w, *now);
        events.extend(e.take_events());
        wakes.extend(e.take_wakes());
    }
    events
}

/// Whether every job of `ids` finished.
fn all_done(ev: &[Event], ids: &[usize]) -> bool {
    ids.iter().all(|id| {
        ev.iter()
            .any(|x| matches!(x, Event::Done { id: i, .. } if i == id))
    })
}

/// Whether an event is a decode OOM.
fn is_oom(e: &Event) -> bool {
    matches!(e, Event::DecodeOom { .. })
}

const P: WorkerId = WorkerId(0);
const D: WorkerId = WorkerId(1);

#[test]
fn p_to_d_turn_leaves_the_session_resident_and_direct_reuses_it() {
    let mut e = engine(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, 32.0);
    let mut now = 0;
    e.start_p_to_d(job(1, 7, &[1, 2, 3], 1500, 4), P, D, now);
    let ev = settle(&mut e, &mut now);
    let first = ev
        .iter()
        .position(|x| matches!(x, Event::FirstToken { id: 1, .. }))
        .expect("first token");
    let done = ev
        .iter()
        .position(|x| matches!(x, Event::Done { id: 1, .. }))
        .expect("done");
    assert!(first < done);
    assert!(matches!(
        ev[done],
        Event::Done {
            resident_tokens: 1504,
            cached: 0,
            ..
        }
    ));
    assert_eq!(e.resident_tokens(D, SessionId(7)), Some(1504));
    let s = e.state(D);
    assert_eq!(
        (s.used_tokens, s.evictable_tokens, s.resident_sessions),
        (1504, 1504, 1)
    );
    // The next turn extends the prompt: two full blocks are reused on D.
    let adm = e.try_direct(job(2, 7, &[1, 2, 4, 5], 1900, 3), D, 403, now);
    assert_eq!(adm, DirectAdmission::Admitted { cached: 1024 });
    assert_eq!(
        e.state(D).evictable_tokens,
        0,
        "a running session is not evictable"
    );
    let ev = settle(&mut e, &mut now);
    assert!(ev.iter().any(|x| matches!(
        x,
        Event::Done {
            id: 2,
            resident_tokens: 1903,
            cached: 1024,
            ..
        }
    )));
    // A session that is not on D cannot go direct.
    assert_eq!(
        e.try_direct(job(3, 8, &[9], 100, 1), D, 10, now),
        DirectAdmission::NotResident
    );
}

#[test]
fn a_reseed_releases_the_session_on_the_other_decode_workers() {
    let d2 = WorkerId(2);
    let roles = [WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Decode];
    let mut e = engine(&roles, 8192, 32.0);
    let mut now = 0;
    e.reseed(job(1, 7, &[1, 2, 3], 1500, 4), P, D, now);
    settle(&mut e, &mut now);
    e.reseed(job(2, 8, &[9], 100, 1), P, d2, now);
    settle(&mut e, &mut now);
    assert_eq!(e.resident_tokens(D, SessionId(7)), Some(1504));
    // A one-token answer writes no KV past its prompt.
    assert_eq!(e.resident_tokens(d2, SessionId(8)), Some(100));
    // Session 7 moves to d2: D holds it no more; session 8 stays where it is.
    e.reseed(job(3, 7, &[1, 2, 3, 4], 2000, 4), P, d2, now);
    assert_eq!(e.resident_tokens(D, SessionId(7)), None);
    assert_eq!(e.state(D).used_tokens, 0);
    settle(&mut e, &mut now);
    assert_eq!(e.resident_tokens(d2, SessionId(7)), Some(2004));
    assert_eq!(e.resident_tokens(d2, SessionId(8)), Some(100));
}

#[test]
fn direct_admission_rejects_an_estimate_over_the_room() {
    let mut e = engine(&[WorkerRole::Prefill, WorkerRole::Decode], 4096, 32.0);
    let mut now = 0;
    e.start_p_to_d(job(1, 1, &[1, 2, 3, 4], 2000, 10), P, D, now);
    settle(&mut e, &mut now);
    // 2,010 used, 2,086 free; the session's own idle tokens do not count as room for it.
    // (The fourth block was partial; grown into a full block it has a new id.)
    assert_eq!(
        e.try_direct(job(2, 1, &[1, 2, 3, 6, 5], 2100, 10), D, 2_087, now),
        DirectAdmission::Rejected
    );
    assert_eq!(
        e.try_direct(job(2, 1, &[1, 2, 3, 6, 5], 2100, 10), D, 2_086, now),
        DirectAdmission::Admitted { cached: 1536 }
    );
}

#[test]
fn idle_sessions_are_evicted_for_a_transfer_and_reported() {
    let mut e = engine(&[WorkerRole::Prefill, WorkerRole::Decode], 4096, 32.0);
    let mut now = 0;
    e.start_p_to_d(job(1, 1, &[1, 2, 3, 4], 2000, 10), P, D, now);
    settle(&mut e, &mut now);
    // 2,010 tokens resident, 2,086 free: a 2,510-token arrival needs the idle session gone.
    e.start_p_to_d(job(2, 2, &[11, 12, 13, 14, 15], 2500, 10), P, D, now);
    let ev = settle(&mut e, &mut now);
    assert!(ev.iter().any(|x| matches!(
        x,
        Event::Evicted {
            session: SessionId(1),
            worker: D
        }
    )));
    assert_eq!(e.resident_tokens(D, SessionId(1)), None);
    assert_eq!(e.resident_tokens(D, SessionId(2)), Some(2510));
}

#[test]
fn a_transfer_without_room_times_out() {
    let mut e = engine(&[WorkerRole::Prefill, WorkerRole::Decode], 4096, 2.0);
    let mut now = 0;
    // A long-running request holds most of D while the second transfer waits.
    e.start_p_to_d(job(1, 1, &[1, 2, 3, 4], 2000, 1_000_000), P, D, now);
    let mut wakes = Vec::new();
    let mut events = Vec::new();
    // Run until the first request decodes, then start the second one.
    loop {
        events.extend(e.take_events());
        wakes.extend(e.take_wakes());
        if events
            .iter()
            .any(|x| matches!(x, Event::FirstToken { id: 1, .. }))
        {
            break;
        }
        wakes.sort_by_key(|(t, _)| *t);
        let (t, w) = wakes.remove(0);
        now = t;
        e.wake(w, now);
    }
    e.start_p_to_d(job(2, 2, &[11, 12, 13, 14], 2000, 10), P, D, now);
    let deadline = now + micros(2.0);
    let mut timed_out = None;
    for _ in 0..1_000_000 {
        events.extend(e.take_events());
        if let Some(Event::TransferTimedOut { id, at, .. }) = events
            .iter()
            .find(|x| matches!(x, Event::TransferTimedOut { .. }))
        {
            timed_out = Some((*id, *at));
            break;
        }
        wakes.extend(e.take_wakes());
        wakes.sort_by_key(|(t, _)| *t);
        let (t, w) = wakes.remove(0);
        now = t;
        e.wake(w, now);
    }
    let (id, at) = timed_out.expect("the second transfer times out");
    assert_eq!(id, 2);
    assert!(
        at >= deadline && at < deadline + micros(1.0),
        "{at} vs {deadline}"
    );
    assert_eq!(e.resident_tokens(D, SessionId(2)), None);
}

#[test]
fn a_session_with_a_request_in_flight_is_not_idle() {
    for pin in [true, false] {
        let mut e = engine_with(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, |p| {
            p.fit.pressure.pin_in_flight = pin;
        });
        let mut now = 0;
        e.start_p_to_d(job(1, 1, &[1, 2, 3, 4], 2000, 10), P, D, now);
        settle(&mut e, &mut now);
        assert_eq!(e.state(D).evictable_tokens, 2010);
        // The next turn is sent: D preallocates its whole context at once (there is room),
        // replacing the session's old KV, and no eviction can take that room back while
        // the request is on P or on the wire, pinned or not.
        e.start_p_to_d(job(2, 1, &[1, 2, 3, 4, 5], 2500, 10), P, D, now);
        let (ok, freed, evicted) = e.commit_evict(D, 8192, None, now);
        assert_eq!(e.state(D).evictable_tokens, 0);
        let busy: Vec<_> = e.residents(D).iter().map(|r| (r.0, r.1, r.3)).collect();
        assert_eq!(busy, vec![(SessionId(1), 2500, true)]);
        assert_eq!((ok, freed, evicted), (false, 0, vec![]));
        // Either way the turn completes and leaves its new KV resident.
        let ev = settle(&mut e, &mut now);
        assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 2, .. })));
        assert_eq!(e.resident_tokens(D, SessionId(1)), Some(2510));
        assert_eq!(e.state(D).evictable_tokens, 2510);
    }
}

/// Two long decodes on a pool that holds only one of them whole: the second is admitted
/// with the decode reserve, outgrows it, and is retracted (SGLang's choice: the fewest
/// tokens generated). D can prefill (it serves turns alone), so it recomputes. Returns the
/// events.
fn outgrow(max_retractions: u32) -> Vec<Event> {
    let mut e = engine_with(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, |p| {
        p.fit.pressure.decode_reserve_tokens = 256;
        p.fit.pressure.max_retractions = max_retractions;
    });
    e.workers[D.0 as usize].recomputes = true;
    outgrow_on(e)
}

/// The two decodes of [`outgrow`] on engine `e`.
fn outgrow_on(mut e: Engine) -> Vec<Event> {
    let mut now = 0;
    e.start_p_to_d(job(1, 1, &[1, 2, 3, 4, 5, 6], 3000, 3000), P, D, now);
    e.start_p_to_d(job(2, 2, &[11, 12, 13], 1500, 3000), P, D, now);
    let ev = settle(&mut e, &mut now);
    // Nothing is left behind: both sessions idle or gone, the pool consistent.
    let s = e.state(D);
    assert_eq!(s.used_tokens, s.evictable_tokens);
    ev
}

#[test]
fn decode_that_outgrows_the_pool_is_retracted_and_recomputed() {
    let ev = outgrow(3);
    let retracted = ev
        .iter()
        .filter(|x| matches!(x, Event::Retracted { id: 2, worker: D }))
        .count();
    assert!(retracted >= 1, "{ev:?}");
    assert!(
        !ev.iter()
            .any(|x| matches!(x, Event::Retracted { id: 1, .. }))
    );
    for id in [1, 2] {
        assert!(
            ev.iter()
                .any(|x| matches!(x, Event::Done { id: i, .. } if *i == id))
        );
        let firsts = ev
            .iter()
            .filter(|x| matches!(x, Event::FirstToken { id: i, .. } if *i == id))
            .count();
        assert_eq!(firsts, 1, "job {id}: one first token, retracted or not");
    }
}

#[test]
fn decode_retracted_past_the_limit_fails_with_decode_oom() {
    let ev = outgrow(0);
    assert!(
        ev.iter()
            .any(|x| matches!(x, Event::DecodeOom { id: 2, .. }))
    );
    assert!(!ev.iter().any(|x| matches!(x, Event::Done { id: 2, .. })));
    assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 1, .. })));
}

/// [`outgrow`] on a decode-only worker (stock SGLang: no prefill path) with a host pool
/// of `host_pool` tokens for retracted requests' KV.
fn outgrow_decode_only(host_pool: u64) -> (Vec<Event>, u32) {
    let e = engine_with(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, |p| {
        p.fit.pressure.decode_reserve_tokens = 256;
        p.fit.pressure.retraction_host_pool_tokens = host_pool;
    });
    assert!(!e.workers[D.0 as usize].recomputes);
    let ev = outgrow_on(e);
    let recomputes = ev
        .iter()
        .filter(|x| matches!(x, Event::Retracted { id: 2, .. }))
        .count() as u32;
    (ev, recomputes)
}

#[test]
fn a_decode_only_worker_without_host_room_fails_a_retracted_request_at_once() {
    let (ev, retracted) = outgrow_decode_only(0);
    assert_eq!(retracted, 0, "{ev:?}");
    assert!(
        ev.iter()
            .any(|x| matches!(x, Event::DecodeOom { id: 2, .. }))
    );
    assert!(!ev.iter().any(|x| matches!(x, Event::Done { id: 2, .. })));
    assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 1, .. })));
    // Too small a pool for the request's KV is no pool.
    let (ev, _) = outgrow_decode_only(1000);
    assert!(
        ev.iter()
            .any(|x| matches!(x, Event::DecodeOom { id: 2, .. }))
    );
}

#[test]
fn a_decode_only_worker_backs_a_retracted_request_up_and_loads_it_back() {
    let (ev, retracted) = outgrow_decode_only(8192);
    assert!(retracted >= 1, "{ev:?}");
    assert!(!ev.iter().any(is_oom), "{ev:?}");
    assert!(all_done(&ev, &[1, 2]), "{ev:?}");
}

#[test]
fn a_decode_only_worker_admits_no_transfer_while_a_retracted_request_waits() {
    let mut e = engine_with(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, |p| {
        p.fit.pressure.decode_reserve_tokens = 256;
        p.fit.pressure.retraction_host_pool_tokens = 8192;
    });
    let mut now = 0;
    e.start_p_to_d(job(1, 1, &[1, 2, 3, 4, 5, 6], 3000, 400), P, D, now);
    run_to_first_token(&mut e, 1, &mut now);
    e.retract(1, now);
    assert_eq!(e.workers[D.0 as usize].host_backup, 3001);
    // Another session's request holds 6,000 tokens: the retracted request does not fit.
    let other = ResidentEntry::running(6000, job(9, 9, &[99], 6000, 1).hashes, now);
    e.workers[D.0 as usize]
        .residents
        .insert(SessionId(9), other);
    e.workers[D.0 as usize].resident_tokens += 6000;
    // A small transfer that fits the pool waits behind the retracted request...
    e.start_p_to_d(job(2, 2, &[11], 500, 2), P, D, now);
    assert_eq!(e.state(D).queue_depth, 2);
    assert_eq!(e.state(D).used_tokens, 6000);
    // ...and goes once the retracted request is back.
    e.drop_resident(D, SessionId(9));
    e.retry_waiting(D, now);
    assert_eq!(e.state(D).queue_depth, 0);
    assert_eq!(e.workers[D.0 as usize].host_backup, 0);
    let ev = settle(&mut e, &mut now);
    assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 1, .. })));
    assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 2, .. })));
    // Loaded back, not recomputed: no first token again.
    assert!(
        !ev.iter()
            .any(|x| matches!(x, Event::FirstToken { id: 1, .. }))
    );
}

#[test]
fn tiered_eviction_on_a_decode_only_worker_takes_only_sessions_it_can_back_up() {
    for (host_pool, retracted) in [(0, false), (16_384, true)] {
        let mut profile = Profile::default();
        profile.hardware.kv_pool_tokens = 8192;
        profile.model.max_input_tokens = 8000;
        profile.fit.pressure.decode_reserve_tokens = 64;
        profile.fit.pressure.retraction_host_pool_tokens = host_pool;
        let opts = EngineOptions {
            eviction: EvictionConfig::default(),
            block_size: BlockSize::default(),
        };
        let mut e = Engine::new(
            profile,
            opts,
            &[WorkerRole::Prefill, WorkerRole::Decode],
            1,
            0.0,
        );
        let mut now = 0;
        // A running request holds 97% of D; a transfer needs room there.
        e.start_p_to_d(job(1, 1, &[1], 7900, 100), P, D, now);
        let mut ev = Vec::new();
        while !ev
            .iter()
            .any(|x| matches!(x, Event::FirstToken { id: 1, .. }))
        {
            let mut wakes = e.take_wakes();
            wakes.sort_by_key(|(t, _)| *t);
            let (t, w) = wakes.remove(0);
            e.wakes.extend(wakes);
            now = t;
            e.wake(w, now);
            ev.extend(e.take_events());
        }
        e.start_p_to_d(job(2, 2, &[2], 2000, 2), P, D, now);
        ev.extend(settle(&mut e, &mut now));
        assert_eq!(
            ev.iter()
                .any(|x| matches!(x, Event::Retracted { id: 1, .. })),
            retracted,
            "host pool {host_pool}: {ev:?}"
        );
        assert!(!ev.iter().any(is_oom), "{ev:?}");
        assert!(all_done(&ev, &[1, 2]), "{ev:?}");
    }
}

#[test]
fn the_token_ratio_decays_per_decode_step_and_a_retraction_resets_it() {
    let mut e = engine_with(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, |p| {
        p.fit.pressure.new_token_ratio_decay_steps = 10;
    });
    let mut now = 0;
    let ratio = |e: &Engine| e.workers[D.0 as usize].token_ratio;
    assert_eq!(ratio(&e), 0.7);
    // Four decode steps (the first token comes with the transfer): 0.7 − 4 × 0.0602.
    e.start_p_to_d(job(1, 1, &[1, 2], 1000, 5), P, D, now);
    settle(&mut e, &mut now);
    assert!((ratio(&e) - (0.7 - 4.0 * (0.7 - 0.098) / 10.0)).abs() < 1e-9);
    // Many more steps: it stays at the floor.
    e.start_p_to_d(job(2, 2, &[3, 4], 1000, 40), P, D, now);
    settle(&mut e, &mut now);
    assert_eq!(ratio(&e), 0.098);
    // A retraction sets it back: the worker admits cautiously again.
    let id = 3;
    e.start_p_to_d(job(id, 3, &[5, 6], 1000, 1_000), P, D, now);
    run_to_first_token(&mut e, 3, &mut now);
    e.retract(id, now);
    assert_eq!(ratio(&e), 0.7);
}

#[test]
fn running_requests_count_for_the_ratio_of_their_reserve_at_admission() {
    // 8,192 tokens; a decoding request of 4,000 (context allocated so far) is active.
    for (ratio, admitted) in [(1.0, false), (0.1, true)] {
        let mut e = engine_with(&[WorkerRole::Prefill, WorkerRole::Decode], 8192, |p| {
            p.fit.pressure.decode_reserve_tokens = 512;
            p.fit.pressure.init_new_token_ratio = ratio;
            p.fit.pressure.min_new_token_ratio = ratio;
        });
        let mut now = 0;
        e.start_p_to_d(
            job(1, 1, &[1, 2, 3, 4, 5, 6, 7, 8], 4000, 1_000_000),
            P,
            D,
            now,
        );
        run_to_first_token(&mut e, 1, &mut now);
        // 3,400 more tokens: with the whole reserve of both (1,024) they do not fit the
        // 4,192 free; with its own and a tenth of the running one's (512 + 52) they do.
        e.start_p_to_d(job(2, 2, &[11, 12, 13, 14, 15, 16, 17], 3400, 4), P, D, now);
        assert_eq!(e.state(D).queue_depth == 0, admitted, "ratio {ratio}");
    }
}

#[test]
fn kv_that_does_not_arrive_in_time_fails_and_breaks_the_pair_on_p() {
    let d2 = WorkerId(2);
    let roles = [WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Decode];
    let mut e = engine_with(&roles, 65_536, |p| {
        p.fit.transfer_timeout_s = 0.001;
        p.fit.pressure.timeout_until_arrival = true;
        p.fit.pressure.failed_pair_recovery_s = 100.0;
    });
    let mut now = 0;
    // Room on D at once, but P's prefill takes longer than the timeout: D gives up, the
    // room is released, and P's send to it fails.
    e.start_p_to_d(job(1, 1, &[1, 2, 3, 4, 5, 6, 7, 8], 4000, 4), P, D, now);
    let ev = settle(&mut e, &mut now);
    assert!(
        ev.iter()
            .any(|x| matches!(x, Event::TransferTimedOut { id: 1, .. }))
    );
    assert!(
        !ev.iter()
            .any(|x| matches!(x, Event::FirstToken { id: 1, .. }))
    );
    assert_eq!(e.state(D).used_tokens, 0);
    // With time to spare, P's next transfer to that D fails as soon as its KV is ready;
    // its transfer to the other D goes through.
    e.profile.fit.transfer_timeout_s = 32.0;
    e.start_p_to_d(job(2, 2, &[11, 12], 1000, 4), P, D, now);
    e.start_p_to_d(job(3, 3, &[21, 22], 1000, 4), P, d2, now);
    let start = now;
    let ev = settle(&mut e, &mut now);
    let failed_at = ev
        .iter()
        .find_map(|x| match x {
            Event::TransferTimedOut { id: 2, at, .. } => Some(*at),
            _ => None,
        })
        .expect("the transfer over the dead pair fails");
    assert!(failed_at < start + micros(1.0));
    assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 3, .. })));
    assert_eq!(e.resident_tokens(D, SessionId(2)), None);
    // Once the pair has recovered, transfers to that D go through again.
    now += micros(100.0);
    e.start_p_to_d(job(4, 2, &[11, 12], 1000, 4), P, D, now);
    let ev = settle(&mut e, &mut now);
    assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 4, .. })));
}

fn hosting_engine(caps: &[(WorkerRole, Capabilities)], pool: u64) -> Engine {
    let mut profile = Profile::default();
    profile.hardware.kv_pool_tokens = pool;
    profile.model.max_input_tokens = pool / 2;
    let eviction = EvictionConfig {
        allow_cold: false,
        allow_hot: false,
        ..EvictionConfig::default()
    };
    Engine::with_layout(
        profile,
        EngineOptions {
            eviction,
            block_size: BlockSize::default(),
        },
        caps,
        1,
        0.0,
    )
}

#[test]
fn a_local_turn_reuses_what_its_worker_holds_and_keeps_the_session() {
    let d = Capabilities::of_role(WorkerRole::Decode).with_local();
    let mut e = hosting_engine(&[(WorkerRole::Decode, d), (WorkerRole::Decode, d)], 8192);
    let (w0, w1) = (WorkerId(0), WorkerId(1));
    let mut now = 0;
    // Session 1 is served alone on w0 from scratch.
    let adm = e.try_local(job(1, 1, &[1, 2, 3], 1500, 4), w0, 1504, now);
    assert_eq!(adm, LocalAdmission::Started { cached: 0 });
    settle(&mut e, &mut now);
    assert_eq!(e.resident_tokens(w0, SessionId(1)), Some(1504));
    // Session 2 shares two blocks with session 1's KV on w0: they are not computed again.
    let adm = e.try_local(job(2, 2, &[1, 2, 7, 8], 2000, 4), w0, 2004, now);
    assert_eq!(adm, LocalAdmission::Started { cached: 1024 });
    settle(&mut e, &mut now);
    // Session 1 moves to w1: its KV on w0 is released when the turn is sent.
    let adm = e.try_local(job(3, 1, &[1, 2, 3, 9], 1900, 4), w1, 1904, now);
    assert_eq!(adm, LocalAdmission::Started { cached: 0 });
    assert_eq!(e.resident_tokens(w0, SessionId(1)), None);
    let ev = settle(&mut e, &mut now);
    assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 3, .. })));
    assert_eq!(e.resident_tokens(w1, SessionId(1)), Some(1904));
    // A resident session's large append extends its KV in place.
    let adm = e.try_local(job(4, 1, &[1, 2, 3, 10, 11, 12], 3000, 4), w1, 1200, now);
    assert_eq!(adm, LocalAdmission::Started { cached: 1536 });
}

#[test]
fn a_local_turn_waits_in_order_behind_a_transfer() {
    let d = Capabilities::of_role(WorkerRole::Decode).with_local();
    let p = Capabilities::of_role(WorkerRole::Prefill);
    let mut e = hosting_engine(&[(WorkerRole::Prefill, p), (WorkerRole::Decode, d)], 8192);
    let mut now = 0;
    // A long decode holds most of D.
    e.start_p_to_d(
        job(1, 1, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 5000, 400),
        P,
        D,
        now,
    );
    loop {
        let ev = e.take_events();
        if ev
            .iter()
            .any(|x| matches!(x, Event::FirstToken { id: 1, .. }))
        {
            break;
        }
        let mut wakes = e.take_wakes();
        wakes.sort_by_key(|(t, _)| *t);
        let (t, w) = wakes.remove(0);
        for (t2, w2) in wakes {
            e.wakes.push((t2, w2));
        }
        now = t;
        e.wake(w, now);
    }
    // A transfer that does not fit waits in D's queue; a local turn that would fit
    // queues behind it rather than overtaking.
    e.start_p_to_d(job(2, 2, &[21, 22, 23, 24, 25, 26], 3000, 10), P, D, now);
    assert_eq!(e.state(D).queue_depth, 1);
    // It would fit now, but it is not first in line.
    let adm = e.try_local(job(3, 3, &[31], 400, 4), D, 404, now);
    assert_eq!(adm, LocalAdmission::Queued);
    assert_eq!(e.state(D).queue_depth, 2);
    let ev = settle(&mut e, &mut now);
    let at = |id| {
        ev.iter()
            .find_map(|x| match x {
                Event::FirstToken { id: i, at } if *i == id => Some(*at),
                Event::Done { id: i, at, .. } if *i == id && id == 1 => Some(*at),
                _ => None,
            })
            .expect("event")
    };
    // The transfer got its room when the long decode ended; the local turn after it.
    assert!(at(3) >= at(1), "the local turn overtook the transfer");
    assert!(ev.iter().any(|x| matches!(x, Event::Done { id: 3, .. })));
    // A prompt over the pool is refused outright.
    assert_eq!(
        e.try_local(job(4, 4, &[41], 8000, 4), D, 8004, now),
        LocalAdmission::Rejected
    );
}

#[test]
fn a_worker_that_hosts_sessions_prefills_for_another_in_one_pool() {
    let x = Capabilities::ALL;
    let mut e = hosting_engine(&[(WorkerRole::Decode, x), (WorkerRole::Decode, x)], 8192);
    let (x0, x1) = (WorkerId(0), WorkerId(1));
    let mut now = 0;
    // Session 1 lives on x0.
    e.try_local(job(1, 1, &[1, 2, 3], 1500, 2), x0, 1502, now);
    settle(&mut e, &mut now);
    // x0 prefills session 2 for x1; it reuses the blocks of session 1's KV.
    e.reseed(job(2, 2, &[1, 2, 5, 6], 2000, 3), x0, x1, now);
    let ev = settle(&mut e, &mut now);
    assert!(ev.iter().any(|x| matches!(
        x,
        Event::Done {
            id: 2,
            cached: 1024,
            ..
        }
    )));
    assert_eq!(e.resident_tokens(x1, SessionId(2)), Some(2003));
    // x0's pool holds session 1 and the prefix cache of the work it did for x1.
    let s = e.state(x0);
    assert_eq!(s.used_tokens, 1502 + 4 * 512);
    assert_eq!(s.evictable_tokens, s.used_tokens);
    assert_eq!(s.resident_sessions, 1);
}

#[test]
fn a_session_migrated_with_its_kv_is_prefilled_from_its_old_worker_s_blocks() {
    let (x0, x1) = (WorkerId(0), WorkerId(1));
    // Session 1 lives on x0 (three blocks); its next turn (one more block) moves to x1, by
    // `migrate` or by `reseed`, with x0 as its prefill worker.
    let moved = |migrate: bool| {
        let x = Capabilities::ALL;
        let mut e = hosting_engine(&[(WorkerRole::Decode, x), (WorkerRole::Decode, x)], 8192);
        let mut now = 0;
        e.try_local(job(1, 1, &[1, 2, 3], 1536, 2), x0, 1538, now);
        settle(&mut e, &mut now);
        assert_eq!(e.resident_tokens(x0, SessionId(1)), Some(1538));
        let next = job(2, 1, &[1, 2, 3, 4], 2048, 3);
        if migrate {
            e.migrate(next, x0, x1, now);
        } else {
            e.reseed(next, x0, x1, now);
        }
        let cached = settle(&mut e, &mut now).iter().find_map(|x| match x {
            Event::Done { id: 2, cached, .. } => Some(*cached),
            _ => None,
        });
        (e, cached)
    };
    // With its KV: x0 prefills the new block only.
    let (e, cached) = moved(true);
    assert_eq!(cached, Some(1536));
    // The session lives on x1 alone; x0 keeps its blocks as evictable prefix cache.
    assert_eq!(e.resident_tokens(x1, SessionId(1)), Some(2051));
    assert_eq!(e.resident_tokens(x0, SessionId(1)), None);
    let s = e.state(x0);
    assert_eq!((s.resident_sessions, s.used_tokens), (0, 4 * 512));
    assert_eq!(s.evictable_tokens, s.used_tokens);
    // As a reseed, x0 lets the session go first and computes the whole context.
    let (e, cached) = moved(false);
    assert_eq!(cached, Some(0));
    assert_eq!(e.resident_tokens(x1, SessionId(1)), Some(2051));
}

#[test]
fn colocated_worker_reuses_its_prefix_cache() {
    let mut e = engine(&[WorkerRole::Colocated], 8192, 32.0);
    let w = WorkerId(0);
    let mut now = 0;
    e.start_colocated(job(1, 1, &[1, 2, 3], 1400, 2), w, now);
    let ev = settle(&mut e, &mut now);
    assert!(ev.iter().any(|x| matches!(
        x,
        Event::Done {
            id: 1,
            cached: 0,
            resident_tokens: 0,
            ..
        }
    )));
    e.start_colocated(job(2, 1, &[1, 2, 4, 5], 2000, 2), w, now);
    let ev = settle(&mut e, &mut now);
    assert!(ev.iter().any(|x| matches!(
        x,
        Event::Done {
            id: 2,
            cached: 1024,
            ..
        }
    )));
    // Blocks stay cached and become evictable once nothing runs.
    let s = e.state(w);
    assert_eq!(s.used_tokens, 5 * 512);
    assert_eq!(s.evictable_tokens, 5 * 512);
}

/// Two prefill pieces of the default profile: 1,000 new tokens after 3,000 cached, and 500
/// new. Linear FLOPs 2 × 3.3025e9 active params × 1,500 new; attention 4 × 48 layers × 32
/// q_heads × 128 head_dim × (1,000 × 3,500 + 500 × 250).
const PIECES: [(u64, u64); 2] = [(1000, 3000), (500, 0)];

#[test]
fn prefill_flops_split_into_linear_and_attention() {
    let p = Profile::default();
    let f = p.prefill_flops(PIECES);
    assert!((f.linear - 9.9075e12).abs() < 1.0, "{f:?}");
    assert!((f.attention - 2.850816e12).abs() < 1.0, "{f:?}");
}

#[test]
fn without_an_attention_efficiency_prefill_runs_at_one_efficiency() {
    let p = Profile::default();
    assert_eq!(p.fit.attention_efficiency, None);
    // 1.27583e13 FLOPs at 0.85 × 989e12 FLOP/s, plus 1 ms.
    let t = p.prefill_seconds(PIECES);
    assert!((t - 0.016_176_727_532_266_7).abs() < 1e-15, "{t}");
    // Bit for bit the one-efficiency formula, summed piece by piece.
    let m = &p.model;
    let attn = 4.0 * f64::from(m.layers) * f64::from(m.q_heads) * f64::from(m.head_dim);
    let lin = 2.0 * p.active_params();
    let flops = PIECES.iter().fold(0.0, |acc, &(n, c)| {
        let n = n as f64;
        acc + (lin * n + attn * n * (c as f64 + n / 2.0))
    });
    let old = flops / (p.fit.prefill_efficiency * p.hardware.peak_flops)
        + p.fit.prefill_overhead_ms / 1e3;
    assert_eq!(t.to_bits(), old.to_bits());
    // The key is not written when absent, and a profile without it reads back equal.
    let text = toml::to_string(&p).unwrap();
    assert!(!text.contains("attention_efficiency"), "{text}");
    assert_eq!(Profile::parse(&text, "written").unwrap(), p);
}

#[test]
fn an_attention_efficiency_divides_the_attention_flops() {
    let mut p = Profile::default();
    p.fit.attention_efficiency = Some(0.25);
    // 9.9075e12 linear FLOPs at 0.85 × 989e12, 2.850816e12 attention FLOPs at 0.25 × 989e12,
    // plus 1 ms.
    let t = p.prefill_seconds(PIECES);
    assert!((t - 0.024_315_618_152_62).abs() < 1e-14, "{t}");
    // At the prefill efficiency, the same time as without it.
    p.fit.attention_efficiency = Some(p.fit.prefill_efficiency);
    let same = p.prefill_seconds(PIECES);
    assert!((same - 0.016_176_727_532_266_7).abs() < 1e-15, "{same}");
    // Written and read back.
    p.fit.attention_efficiency = Some(0.25);
    let text = toml::to_string(&p).unwrap();
    assert!(text.contains("attention_efficiency = 0.25"), "{text}");
    assert_eq!(Profile::parse(&text, "written").unwrap(), p);
}

#[test]
fn an_attention_efficiency_must_be_a_fraction_of_peak() {
    let with = |v: &str| {
        profile::DEFAULT_PROFILE_TOML.replace(
            "prefill_overhead_ms = 1.0",
            &format!("prefill_overhead_ms = 1.0\nattention_efficiency = {v}"),
        )
    };
    for (v, says) in [
        (
            "0.0",
            "fit.attention_efficiency must be a positive number (got 0)",
        ),
        (
            "-0.2",
            "fit.attention_efficiency must be a positive number (got -0.2)",
        ),
        (
            "nan",
            "fit.attention_efficiency must be a positive number (got NaN)",
        ),
        (
            "1.5",
            "fit.attention_efficiency is a fraction of peak: at most 1 (got 1.5)",
        ),
    ] {
        let err = Profile::parse(&with(v), "p.toml").unwrap_err().to_string();
        assert!(err.contains(says), "{v}: {err}");
    }
    let p = Profile::parse(&with("1.0"), "p.toml").unwrap();
    assert_eq!(p.fit.attention_efficiency, Some(1.0));
}

#[test]
fn every_profile_in_the_repository_loads() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("profiles/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            let p = Profile::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(p.prefill_seconds([(1024, 0)]) > 0.0, "{}", path.display());
            names.push(p.name);
        }
    }
    names.sort();
    assert_eq!(names, ["qwen3-30b-a3b-h100", "tiny-llama-cpu"]);
}
