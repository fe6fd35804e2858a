//! Typed values from JSON, DeepSpeed's way ([`Scalar`]): integers written `5e8` or `1.0` are
//! integers, booleans must be booleans.

use serde_json::Value;

/// A JSON value that converts to a typed one, DeepSpeed's way: integers written as `5e8` or
/// `1.0` are integers, booleans must be booleans.
pub(crate) trait Scalar: Sized {
    /// What the key accepts, for errors.
    const EXPECTED: &'static str;
    fn from_value(v: &Value) -> Option<Self>;
    fn to_json(&self) -> Value;
}

/// An exactly integral finite float, as integer.
pub(crate) fn integral(v: &Value) -> Option<f64> {
    let f = v.as_f64()?;
    (f.is_finite() && f.fract() == 0.0).then_some(f)
}

impl Scalar for bool {
    const EXPECTED: &'static str = "a boolean (true or false)";
    fn from_value(v: &Value) -> Option<Self> {
        v.as_bool()
    }
    fn to_json(&self) -> Value {
        Value::Bool(*self)
    }
}

impl Scalar for u64 {
    const EXPECTED: &'static str = "a non-negative integer (5e8 and 1.0 are accepted)";
    fn from_value(v: &Value) -> Option<Self> {
        v.as_u64().or_else(|| {
            let f = integral(v)?;
            // 2^64 itself is not representable; stay strictly below it.
            (0.0..18_446_744_073_709_551_616.0).contains(&f).then_some(f as u64)
        })
    }
    fn to_json(&self) -> Value {
        Value::from(*self)
    }
}

impl Scalar for usize {
    const EXPECTED: &'static str = u64::EXPECTED;
    fn from_value(v: &Value) -> Option<Self> {
        u64::from_value(v).and_then(|x| usize::try_from(x).ok())
    }
    fn to_json(&self) -> Value {
        Value::from(*self)
    }
}

impl Scalar for u32 {
    const EXPECTED: &'static str = "a non-negative integer below 2^32";
    fn from_value(v: &Value) -> Option<Self> {
        u64::from_value(v).and_then(|x| u32::try_from(x).ok())
    }
    fn to_json(&self) -> Value {
        Value::from(*self)
    }
}

impl Scalar for i64 {
    const EXPECTED: &'static str = "an integer (5e8 and 1.0 are accepted)";
    fn from_value(v: &Value) -> Option<Self> {
        v.as_i64().or_else(|| {
            let f = integral(v)?;
            (-9.223_372_036_854_776e18..9.223_372_036_854_776e18)
                .contains(&f)
                .then_some(f as i64)
        })
    }
    fn to_json(&self) -> Value {
        Value::from(*self)
    }
}

impl Scalar for f64 {
    const EXPECTED: &'static str = "a number";
    fn from_value(v: &Value) -> Option<Self> {
        v.as_f64()
    }
    fn to_json(&self) -> Value {
        Value::from(*self)
    }
}

impl Scalar for String {
    const EXPECTED: &'static str = "a string";
    fn from_value(v: &Value) -> Option<Self> {
        v.as_str().map(str::to_string)
    }
    fn to_json(&self) -> Value {
        Value::String(self.clone())
    }
}

impl Scalar for Vec<String> {
    const EXPECTED: &'static str = "a list of strings";
    fn from_value(v: &Value) -> Option<Self> {
        match v {
            // DeepSpeed's list fields take a lone string as a one-element list.
            Value::String(s) => Some(vec![s.clone()]),
            Value::Array(items) => items.iter().map(|i| i.as_str().map(str::to_string)).collect(),
            _ => None,
        }
    }
    fn to_json(&self) -> Value {
        Value::from(self.clone())
    }
}

impl Scalar for [f64; 2] {
    const EXPECTED: &'static str = "a pair of numbers like [0.9, 0.999]";
    fn from_value(v: &Value) -> Option<Self> {
        match v.as_array()?.as_slice() {
            [a, b] => Some([a.as_f64()?, b.as_f64()?]),
            _ => None,
        }
    }
    fn to_json(&self) -> Value {
        Value::from(self.to_vec())
    }
}

impl Scalar for Value {
    const EXPECTED: &'static str = "any JSON value";
    fn from_value(v: &Value) -> Option<Self> {
        Some(v.clone())
    }
    fn to_json(&self) -> Value {
        self.clone()
    }
}

impl<T: Scalar> Scalar for Option<T> {
    const EXPECTED: &'static str = T::EXPECTED;
    fn from_value(v: &Value) -> Option<Self> {
        if v.is_null() {
            Some(None)
        } else {
            T::from_value(v).map(Some)
        }
    }
    fn to_json(&self) -> Value {
        self.as_ref().map_or(Value::Null, T::to_json)
    }
}
