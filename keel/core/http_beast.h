// Conversion from a parsed Boost.Beast request to keel::HttpRequest, shared by the blocking
// HttpServer and the gateway's coroutine server so both fill path/query/headers the same way.
#pragma once

#include <string>
#include <utility>

#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>

#include "keel/core/http_server.h"

namespace keel {

// Moves the body out of `msg`.
inline HttpRequest ToHttpRequest(boost::beast::http::request<boost::beast::http::string_body>& msg,
                                 std::string remote) {
  HttpRequest req;
  req.method = std::string(msg.method_string());
  req.target = std::string(msg.target());
  const size_t q = req.target.find('?');
  req.path = req.target.substr(0, q);
  if (q != std::string::npos) req.query = req.target.substr(q + 1);
  req.version = msg.version();
  for (const auto& f : msg) req.headers.Add(std::string(f.name_string()), std::string(f.value()));
  req.body = std::move(msg.body());
  req.remote = std::move(remote);
  return req;
}

}  // namespace keel
