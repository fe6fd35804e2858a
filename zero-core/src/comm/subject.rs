//! What a collective moves, as its caller names it: the ranks check that they agree on it, so
//! that two ranks which pair different units (a unit one rank's data skipped) fail at once,
//! naming both, instead of reducing one unit's gradient into another's.

/// The thing a collective gathers or reduces. It travels in the header the ranks already
/// exchange for every collective (op, sequence number, length), so naming costs nothing more.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Subject {
    /// Not named (scalars, checkpoints, anything outside the model's layout).
    #[default]
    Unnamed,
    /// A `ZeroModule` unit, by its place among the model's units in visit order.
    Unit(u32),
    /// A reduction bucket of the flat layout, by its place in the layout's groups.
    Bucket(u32),
}

const UNIT: u64 = 1 << 62;
const BUCKET: u64 = 2 << 62;
const INDEX: u64 = (1 << 62) - 1;

impl Subject {
    /// The wire form: 0 for unnamed, the kind in the top two bits, the index below.
    pub(crate) fn code(self) -> u64 {
        match self {
            Subject::Unnamed => 0,
            Subject::Unit(i) => UNIT | u64::from(i),
            Subject::Bucket(i) => BUCKET | u64::from(i),
        }
    }

    /// Parses [`Subject::code`]'s output; `None` if it is not one.
    pub(crate) fn from_code(code: u64) -> Option<Self> {
        let index = u32::try_from(code & INDEX).ok()?;
        match code & !INDEX {
            0 if code == 0 => Some(Subject::Unnamed),
            UNIT => Some(Subject::Unit(index)),
            BUCKET => Some(Subject::Bucket(index)),
            _ => None,
        }
    }
}

impl std::fmt::Display for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Subject::Unnamed => f.write_str("an unnamed buffer"),
            Subject::Unit(i) => write!(f, "unit {i}"),
            Subject::Bucket(i) => write!(f, "bucket {i}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_differ() {
        let all = [
            Subject::Unnamed,
            Subject::Unit(0),
            Subject::Unit(7),
            Subject::Unit(u32::MAX),
            Subject::Bucket(0),
            Subject::Bucket(7),
        ];
        for s in all {
            assert_eq!(Subject::from_code(s.code()), Some(s));
        }
        let codes: std::collections::HashSet<u64> = all.iter().map(|s| s.code()).collect();
        assert_eq!(codes.len(), all.len());
        assert_eq!(Subject::from_code(3 << 62), None);
        assert_eq!(Subject::from_code(1 << 40), None);
    }
}
