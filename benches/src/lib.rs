//! ember-benches (placeholder, being written).
