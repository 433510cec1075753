//! Payloads written by Python msgspec (`scripts/fixtures.py`, byte-checked by
//! `scripts/check.sh`) decode to the values the script wrote, in every shape.

use kvc_core::{BlockSize, WorkerId};
use kvc_events::{
    BlockRemoved, BlockStored, EngineHash, Event, EventBatch, KvIndex, Medium, WorkerSpec,
    decode_batch,
};
use xxhash_rust::xxh3::xxh3_64;

fn fixture(name: &str) -> EventBatch {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    decode_batch(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn hashes(h: &[u64]) -> Vec<EngineHash> {
    h.iter().map(|h| EngineHash(*h)).collect()
}

#[test]
fn vllm_0_33_map_batch_with_map_events() {
    let b = fixture("vllm033_map.msgpack");
    assert_eq!(b.ts, 1_767_225_600.25);
    assert_eq!(b.dp_rank, Some(2));
    assert_eq!(
        b.events,
        vec![
            Event::Stored(BlockStored {
                block_hashes: hashes(&[u64::MAX - 5, 17]),
                parent: None,
                token_ids: (1..=8).collect(),
                block_size: 4,
                lora_id: None,
                medium: Some(Medium::Gpu),
                lora_name: None,
                session_id: Some("sess-A".into()),
            }),
            Event::Removed(BlockRemoved {
                block_hashes: hashes(&[17]),
                medium: Some(Medium::Gpu),
            }),
            Event::AllCleared,
        ]
    );
}

#[test]
fn array_batch_with_map_events_and_negative_hashes() {
    let b = fixture("vllm033_array_batch.msgpack");
    assert_eq!((b.ts, b.dp_rank), (12.5, Some(0)));
    assert_eq!(
        b.events,
        vec![Event::Stored(BlockStored {
            block_hashes: hashes(&[u64::MAX, 1 << 63]),
            parent: Some(EngineHash::from_i64(-42)),
            token_ids: vec![100, 200],
            block_size: 1,
            ..BlockStored::default()
        })]
    );
}

#[test]
fn positional_vllm_events_with_byte_hashes() {
    let b = fixture("vllm_positional.msgpack");
    assert_eq!((b.ts, b.dp_rank), (3.0, None));
    let h1 = EngineHash(xxh3_64(&[0x01; 32]));
    let h2 = EngineHash(xxh3_64(&[0xab; 32]));
    assert_eq!(
        b.events,
        vec![
            Event::Stored(BlockStored {
                block_hashes: vec![h1, h2],
                parent: Some(EngineHash(xxh3_64(&[0; 32]))),
                token_ids: vec![7, 8, 9, 10],
                block_size: 2,
                ..BlockStored::default()
            }),
            Event::Removed(BlockRemoved {
                block_hashes: vec![h1],
                medium: Some(Medium::Cpu),
            }),
            Event::AllCleared,
        ]
    );
}

#[test]
fn sglang_positional_batch() {
    let b = fixture("sglang_positional.msgpack");
    assert_eq!((b.ts, b.dp_rank), (99.75, Some(1)));
    assert_eq!(
        b.events,
        vec![
            Event::Stored(BlockStored {
                block_hashes: hashes(&[101]),
                parent: Some(EngineHash(100)),
                token_ids: vec![42],
                block_size: 1,
                medium: Some(Medium::Gpu),
                ..BlockStored::default()
            }),
            Event::Removed(BlockRemoved {
                block_hashes: hashes(&[100]),
                medium: Some(Medium::Gpu),
            }),
        ]
    );
}

#[test]
fn unknown_fields_and_omitted_defaults_are_accepted() {
    let b = fixture("vllm_map_unknown_fields.msgpack");
    assert_eq!((b.ts, b.dp_rank), (5.0, None));
    assert_eq!(
        b.events,
        vec![
            Event::Stored(BlockStored {
                block_hashes: hashes(&[5]),
                token_ids: vec![1, 2],
                block_size: 2,
                ..BlockStored::default()
            }),
            Event::AllCleared,
        ]
    );
}

#[test]
fn the_fixtures_index_as_their_events_say() {
    let mut idx = KvIndex::new();
    let w = WorkerId(0);
    idx.add_worker(
        w,
        WorkerSpec {
            block_size: BlockSize::new(4).unwrap(),
            capacity_blocks: 8,
        },
    )
    .unwrap();
    let b = fixture("vllm033_map.msgpack");
    let outcomes: Vec<_> = b.events.iter().map(|e| idx.apply(w, e).unwrap()).collect();
    assert_eq!(outcomes[0].stored, 2);
    assert_eq!(outcomes[1].removed, 1);
    assert!(outcomes[2].cleared);
    assert_eq!(idx.indexed_blocks(w), 0);
}
