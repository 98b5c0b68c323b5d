pub mod messages;
pub mod topics;
