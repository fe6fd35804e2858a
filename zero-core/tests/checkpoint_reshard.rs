//! Save at world size N and stage s, load at world size M and stage t, for every 1 ≤ N, M ≤ 4
//! and every pair of stages: each rank's new owned slices of masters and optimizer buffers must
//! equal the reference function of (parameter, element) exactly, padding zero.

mod checkpoint_support;

use checkpoint_support::*;
use zero_core::checkpoint::{self, Checkpoint};

#[test]
fn any_world_size_and_stage_loads_any_other() {
    let dir = scratch("reshard");
    for n in 1..=4 {
        for s in 0..=3u8 {
            let tag = format!("w{n}s{s}");
            save_reference(&dir, &tag, n, s, 5, "");
            for m in 1..=4 {
                for t in 0..=3u8 {
                    let dir = dir.clone();
                    let tag = tag.clone();
                    on_ranks(m, move |rank, comm| {
                        let new = layout(specs(""), m, t);
                        let (meta, groups) = checkpoint::load(comm.as_ref(), &dir, Some(&tag), &new).expect("load");
                        assert_eq!((meta.world_size, meta.stage, meta.global_step), (n, s, 5));
                        assert_eq!(meta.optimizer.step, 5);
                        assert_eq!(meta.client_state["data_position"], 120);
                        for (g, loaded) in groups.iter().enumerate() {
                            let label = format!("saved w{n} s{s}, loaded w{m} s{t}, rank {rank}, group {g}");
                            assert_eq!(loaded.master, owned(&new, g, rank, 5, 0), "{label}: master");
                            assert_eq!(
                                loaded.state[0],
                                ("exp_avg".to_string(), owned(&new, g, rank, 5, 1)),
                                "{label}"
                            );
                            assert_eq!(
                                loaded.state[1],
                                ("exp_avg_sq".to_string(), owned(&new, g, rank, 5, 2)),
                                "{label}"
                            );
                        }
                    });
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn latest_names_the_newest_save_and_metadata_records_the_layout() {
    let dir = scratch("latest");
    save_reference(&dir, "step3", 2, 1, 3, "");
    save_reference(&dir, "step4", 3, 2, 4, "");
    let c = Checkpoint::open(&dir, None).expect("open latest");
    assert_eq!(c.meta.tag, "step4");
    assert_eq!(c.meta.world_size, 3);
    let old = Checkpoint::open(&dir, Some("step3")).expect("open by tag");
    assert_eq!(old.meta.global_step, 3);
    // Every parameter with name, shape, dtype, group and offset, matching the layout.
    let l = layout(specs(""), 3, 2);
    let places = l.places();
    for (rec, (spec, place)) in c.meta.params.iter().zip(l.params.iter().zip(places)) {
        assert_eq!(
            (&rec.name, &rec.shape, rec.dtype.as_str()),
            (&spec.name, &spec.shape, "F32")
        );
        assert_eq!((rec.group, rec.offset), (place.group, place.offset));
    }
    assert_eq!(c.meta.files.len(), 3);
    c.verify().expect("every checksum holds");
    // Re-saving an existing tag replaces it whole.
    save_reference(&dir, "step3", 1, 0, 7, "");
    let again = Checkpoint::open(&dir, Some("step3")).expect("reopen");
    assert_eq!((again.meta.world_size, again.meta.global_step), (1, 7));
    assert_eq!(Checkpoint::open(&dir, None).expect("latest").meta.tag, "step3");
    assert!(!dir.join("step3.replaced").exists() && !dir.join("step3.partial").exists());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_save_killed_between_its_renames_leaves_the_old_tag_loadable() {
    // The state a save leaves if killed after moving the old `TAG` aside and before moving the
    // new one in: only `TAG.replaced` (complete) and `TAG.partial` (perhaps not) exist.
    let dir = scratch("renames");
    save_reference(&dir, "t", 2, 2, 6, "");
    std::fs::rename(dir.join("t"), dir.join("t.replaced")).unwrap();
    std::fs::create_dir_all(dir.join("t.partial")).unwrap();
    let c = Checkpoint::open(&dir, None).expect("the replaced copy is found");
    assert_eq!(c.meta.global_step, 6);
    c.verify().expect("intact");
    std::fs::remove_dir_all(&dir).ok();
}
