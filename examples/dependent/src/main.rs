//! `cargo run`: the regressor trained two steps at ZeRO stage 3 on two rank threads.

fn main() {
    match zero_dependent::train(2, 2) {
        Ok(runs) => {
            for (rank, run) in runs.iter().enumerate() {
                println!("rank {rank}: loss before each step {:?}", run.losses);
            }
        }
        Err(error) => {
            eprintln!("error: {error}");
            std::process::exit(1);
        }
    }
}
