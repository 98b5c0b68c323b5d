//! `./scripts/bench fleet N`: N real node processes against one mosquitto and the fake backend.

pub fn run(n: usize) {
    println!("fleet of {n}: not yet");
}
