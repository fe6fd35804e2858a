//! The benchmark binaries' command lines: `--flag value` pairs and bare switches, read flag by
//! flag. `--help` (or `-h`) prints the binary's usage and exits with status 0. A missing,
//! malformed or out-of-range value, or an unknown flag, is refused before anything runs: one
//! line on stderr naming the flag, the value and what is valid, and exit status 2.

use std::fmt::Display;
use std::ops::RangeInclusive;
use zero_burn::Stage;
use zero_models::Gpt2Config;

/// Exit status of a refused command line.
pub const USAGE_ERROR: i32 = 2;

/// The largest count a flag takes unless it names its own range: far beyond any run these
/// benchmarks make, and small enough that the sums and products of a few counts (token ids,
/// step numbers, batch × sequence) stay within 64 bits.
pub const MAX_COUNT: usize = 1 << 32;

/// The most threads (rank threads, a pool's workers) or local rank processes a flag may ask
/// for: more than any machine's cores, and few enough that every one's stack and bookkeeping
/// fit in memory.
pub const MAX_THREADS: usize = 1024;

/// The fewest tokens a training sequence may have: the loss predicts each token from the ones
/// before it, so a sequence of one token has no target.
pub const MIN_SEQ: usize = 2;

/// Prints `bin: message` on stderr and exits with [`USAGE_ERROR`].
pub fn refuse(bin: &str, message: impl Display) -> ! {
    eprintln!("{bin}: {message}");
    std::process::exit(USAGE_ERROR)
}

/// A whole number as a command line writes it: digits, optionally grouped with `_`
/// (`100_000_000`), or in exponent form (`1e8`).
pub fn whole(text: &str) -> Option<usize> {
    let text = text.replace('_', "");
    if let Ok(n) = text.parse::<usize>() {
        return Some(n);
    }
    let x: f64 = text.parse().ok()?;
    // 2^64 is exactly representable; every whole f64 below it converts exactly.
    (x.is_finite() && x >= 0.0 && x.fract() == 0.0 && x < 18_446_744_073_709_551_616.0).then_some(x as usize)
}

/// The arguments of one benchmark binary, read flag by flag.
pub struct Args {
    bin: &'static str,
    rest: std::vec::IntoIter<String>,
}

impl Args {
    /// This process's arguments, for the binary `bin` whose usage `--help` prints. One that
    /// is not UTF-8 is refused.
    pub fn new(bin: &'static str, usage: &str) -> Self {
        let args = std::env::args_os()
            .skip(1)
            .map(|a| {
                a.into_string()
                    .unwrap_or_else(|a| refuse(bin, format_args!("{}: not UTF-8", a.to_string_lossy())))
            })
            .collect();
        Self::with_args(bin, usage, args)
    }

    /// `args` (without the program's name), for the binary `bin`. `--help` or `-h` anywhere
    /// prints `usage` on stdout and exits with status 0, whatever else the line holds.
    pub fn with_args(bin: &'static str, usage: &str, args: Vec<String>) -> Self {
        if args.iter().any(|a| a == "--help" || a == "-h") {
            println!("{usage}");
            std::process::exit(0);
        }
        Args {
            bin,
            rest: args.into_iter(),
        }
    }

    /// The next flag, or `None` after the last.
    pub fn flag(&mut self) -> Option<String> {
        self.rest.next()
    }

    /// Refuses the command line with `message` (see [`refuse`]).
    pub fn fail(&self, message: impl Display) -> ! {
        refuse(self.bin, message)
    }

    /// Refuses `flag` as one this binary does not take.
    pub fn unknown(&self, flag: &str) -> ! {
        self.fail(format_args!("unknown flag `{flag}` (--help lists the flags)"))
    }

    /// Refuses `value` of `flag`, saying what `flag` takes.
    pub fn bad(&self, flag: &str, value: &str, expected: impl Display) -> ! {
        self.fail(format_args!("{flag} {value}: expected {expected}"))
    }

    /// The value after `flag`, of which `expected` says what is valid: refused when the line
    /// ends there or the next argument is itself a flag.
    pub fn value(&mut self, flag: &str, expected: impl Display) -> String {
        match self.rest.as_slice().first() {
            Some(next) if !next.starts_with("--") => self.rest.next().unwrap_or_default(),
            _ => self.fail(format_args!("{flag} needs a value: {expected}")),
        }
    }

    /// The value after `flag` as a whole number (see [`whole`]) within `range`.
    pub fn number(&mut self, flag: &str, range: RangeInclusive<usize>) -> usize {
        self.number_because(flag, range, "")
    }

    /// As [`Args::number`], with `why` (if not empty) said after the range when refused.
    fn number_because(&mut self, flag: &str, range: RangeInclusive<usize>, why: &str) -> usize {
        let mut expected = expected_number(&range, false);
        if !why.is_empty() {
            expected = format!("{expected} ({why})");
        }
        let value = self.value(flag, &expected);
        match whole(&value) {
            Some(n) if range.contains(&n) => n,
            _ => self.bad(flag, &value, expected),
        }
    }

    /// The value after `flag` as a count of at least `min` (and at most [`MAX_COUNT`]).
    pub fn count(&mut self, flag: &str, min: usize) -> usize {
        self.number(flag, min..=MAX_COUNT)
    }

    /// The value after `flag` as a comma-separated list of counts, each at least `min`.
    pub fn counts(&mut self, flag: &str, min: usize) -> Vec<usize> {
        self.numbers(flag, min..=MAX_COUNT)
    }

    /// The value after `flag` as a comma-separated list of whole numbers, each within `range`.
    pub fn numbers(&mut self, flag: &str, range: RangeInclusive<usize>) -> Vec<usize> {
        let expected = format!("a comma-separated list of {}", expected_number(&range, true));
        let value = self.value(flag, &expected);
        value
            .split(',')
            .map(|v| whole(v.trim()).filter(|n| range.contains(n)))
            .collect::<Option<Vec<_>>>()
            .unwrap_or_else(|| self.bad(flag, &value, expected))
    }

    /// The value after `flag` as a number of ranks: 1 to [`MAX_THREADS`].
    pub fn ranks(&mut self, flag: &str) -> usize {
        self.number(flag, 1..=MAX_THREADS)
    }

    /// The value after `flag` as a comma-separated list of numbers of ranks, each 1 to
    /// [`MAX_THREADS`].
    pub fn ranks_list(&mut self, flag: &str) -> Vec<usize> {
        self.numbers(flag, 1..=MAX_THREADS)
    }

    /// The value after `flag` as a positive multiple of `of` (at most [`MAX_COUNT`]); `why`
    /// says why when refused.
    pub fn multiple(&mut self, flag: &str, of: usize, why: &str) -> usize {
        let expected = format!(
            "a positive multiple of {of} ({why}), at most {}",
            power_of_two(MAX_COUNT)
        );
        let value = self.value(flag, &expected);
        match whole(&value) {
            Some(n) if n > 0 && n % of == 0 && n <= MAX_COUNT => n,
            _ => self.bad(flag, &value, expected),
        }
    }

    /// The value after `flag` as a training sequence length: a count of at least [`MIN_SEQ`].
    pub fn seq(&mut self, flag: &str) -> usize {
        self.number_because(
            flag,
            MIN_SEQ..=MAX_COUNT,
            "the loss predicts each token from the ones before it",
        )
    }

    /// The value after `flag` as a finite real number of at least `min`.
    pub fn real(&mut self, flag: &str, min: f64) -> f64 {
        let expected = format!("a number of at least {min}");
        let value = self.value(flag, &expected);
        match value.parse::<f64>() {
            Ok(x) if x.is_finite() && x >= min => x,
            _ => self.bad(flag, &value, expected),
        }
    }

    /// The value after `flag`, which must be one of `choices`.
    pub fn choice(&mut self, flag: &str, choices: &[&str]) -> String {
        let expected = one_of(choices);
        let value = self.value(flag, &expected);
        if !choices.contains(&value.as_str()) {
            self.bad(flag, &value, expected);
        }
        value
    }

    /// The value after `flag` as a comma-separated list, each item one of `choices`.
    pub fn choices(&mut self, flag: &str, choices: &[&str]) -> Vec<String> {
        let expected = format!("a comma-separated list of {}", one_of(choices));
        let value = self.value(flag, &expected);
        let items: Vec<String> = value.split(',').map(|v| v.trim().to_string()).collect();
        if !items.iter().all(|v| choices.contains(&v.as_str())) {
            self.bad(flag, &value, expected);
        }
        items
    }

    /// The value after `flag` as a comma-separated list of ZeRO stages, each 0-3.
    pub fn stages(&mut self, flag: &str) -> Vec<Stage> {
        let expected = "a comma-separated list of ZeRO stages, each 0, 1, 2 or 3";
        let value = self.value(flag, expected);
        value
            .split(',')
            .map(|v| v.trim().parse().ok().and_then(Stage::from_number))
            .collect::<Option<Vec<_>>>()
            .unwrap_or_else(|| self.bad(flag, &value, expected))
    }

    /// The value after `flag` as a ZeRO stage, 0-3.
    pub fn stage(&mut self, flag: &str) -> Stage {
        let expected = "a ZeRO stage: 0, 1, 2 or 3";
        let value = self.value(flag, expected);
        value
            .parse()
            .ok()
            .and_then(Stage::from_number)
            .unwrap_or_else(|| self.bad(flag, &value, expected))
    }

    /// The value after `flag` as a comma-separated list of GPT-2 presets
    /// ([`Gpt2Config::preset`]), with their configurations.
    pub fn presets(&mut self, flag: &str) -> Vec<(String, Gpt2Config)> {
        let value = self.value(flag, "a comma-separated list of GPT-2 presets");
        value
            .split(',')
            .map(|name| match Gpt2Config::preset(name.trim()) {
                Ok(config) => (name.trim().to_string(), config),
                Err(e) => self.fail(format_args!("{flag} {value}: {e}")),
            })
            .collect()
    }

    /// The value after `flag` as one GPT-2 preset ([`Gpt2Config::preset`]), with its
    /// configuration.
    pub fn preset(&mut self, flag: &str) -> (String, Gpt2Config) {
        let value = self.value(flag, "a GPT-2 preset");
        match Gpt2Config::preset(&value) {
            Ok(config) => (value, config),
            Err(e) => self.fail(format_args!("{flag} {value}: {e}")),
        }
    }

    /// Refuses `batch` × `seq` tokens per step beyond [`MAX_COUNT`] (`flags` names the two).
    pub fn check_tokens(&self, flags: (&str, &str), batch: usize, seq: usize) {
        self.check_product((flags.0, batch), (flags.1, seq), "tokens per step");
    }

    /// Refuses a product of two counts beyond [`MAX_COUNT`]: `what` says what it counts.
    pub fn check_product(&self, a: (&str, usize), b: (&str, usize), what: &str) {
        if a.1.checked_mul(b.1).is_none_or(|n| n > MAX_COUNT) {
            self.fail(format_args!(
                "{} {} {} {}: expected at most {} {what} ({} × {})",
                a.0,
                a.1,
                b.0,
                b.1,
                power_of_two(MAX_COUNT),
                a.0,
                b.0
            ));
        }
    }
}

/// What a whole number in `range` reads as (`plural`: what several of them read as).
fn expected_number(range: &RangeInclusive<usize>, plural: bool) -> String {
    let (a, number) = if plural { ("", "numbers") } else { ("a ", "number") };
    match (*range.start(), *range.end()) {
        (0, usize::MAX) => format!("{a}whole {number}"),
        (min, usize::MAX) => format!("{a}whole {number} of at least {min}"),
        (min, max) => format!("{a}whole {number} from {min} to {}", power_of_two(max)),
    }
}

/// `n`, as `2^k` when it is a large power of two.
fn power_of_two(n: usize) -> String {
    if n.is_power_of_two() && n >= 1 << 20 {
        format!("2^{}", n.trailing_zeros())
    } else {
        n.to_string()
    }
}

/// `a, b or c`.
fn one_of(choices: &[&str]) -> String {
    match choices {
        [] => String::new(),
        [one] => one.to_string(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}
