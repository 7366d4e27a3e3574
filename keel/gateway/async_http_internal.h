// Private helpers shared by async_http.cc (server) and async_http_client.cc (client). Not part
// of the gateway's API.
#pragma once

#include <algorithm>
#include <chrono>
#include <typeinfo>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/strand.hpp>

namespace keel::gateway::detail {

using Strand = boost::asio::strand<boost::asio::io_context::executor_type>;

// Seconds as a steady_clock duration, clamped so that "forever" (huge values) cannot overflow.
inline std::chrono::steady_clock::duration Seconds(double s) {
  s = std::clamp(s, 0.0, 1e7);
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(s));
}

// True when `ex` serializes its handlers (an io_context strand). Beast streams with timeouts
// must only be driven from a strand when the io_context runs on several threads: the timer's
// handler and the I/O completion both run on the awaiting coroutine's executor.
// (Asio 1.18's any_executor::target<T>() does not check the type, hence target_type().)
inline bool IsStrand(const boost::asio::any_io_executor& ex) {
  return ex.target_type() == typeid(Strand);
}

}  // namespace keel::gateway::detail
